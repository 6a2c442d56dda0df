"""Damaged JPEGs: what the pixel contract answers, and what libjpeg's warnings could tell.

Each file is a photo-like JPEG (``tests/photos.py``, 80-472 px sides) damaged inside its first
scan, the markers and the length intact: 1-127 bytes zeroed, 1-127 bytes randomised, or one bit
flipped (in turn), at a random place. For each: the contract's answer (``pixels.decode``:
refused, or accepted with rows more than 40 levels off the undamaged decode, or accepted with
smaller changes) and the first warning libjpeg gives (simplejpeg's strict decode), grouped.
JPEG has no checksum: the question is how much of the damage a decoder can see at all.

    python benchmarks/damaged_jpeg.py
    python benchmarks/damaged_jpeg.py --files 100 --seed 1

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import numpy as np
from benchlib import emit, log, machine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from photos import photo_jpeg  # noqa: E402  (the pixel tests' photo-like pictures)

WRONG_ROW_LEVELS = 40  # a row counts as wrong when a pixel in it is this far off


def damaged(data: bytes, rng: np.random.Generator, kind: int) -> bytes:
    """``data`` with its scan damaged: bytes zeroed (0), randomised (1), or a bit flipped (2)."""
    start = data.index(b"\xff\xda") + 14  # past the scan header
    where = start + int((len(data) - 2 - start) * rng.random())
    count = int(rng.integers(1, 128))
    if kind == 0:
        return data[:where] + bytes(count) + data[where + count :]
    if kind == 1:
        return data[:where] + rng.bytes(count) + data[where + count :]
    flipped = bytearray(data)
    flipped[where] ^= 1 << int(rng.integers(8))
    return bytes(flipped)


def warning(data: bytes) -> str:
    """libjpeg's first warning or error for ``data`` (``none``), its numbers dropped."""
    import simplejpeg

    try:
        simplejpeg.decode_jpeg(data)
    except ValueError as err:
        text = str(err)
        if "extraneous bytes" in text:
            return "Corrupt JPEG data: N extraneous bytes before marker"
        return "Unsupported marker type" if text.startswith("Unsupported marker") else text
    return "none"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from vit22b.model.errors import InvalidImage
    from vit22b.model.pixels import decode

    rng = np.random.default_rng(args.seed)
    answers: collections.Counter = collections.Counter()
    warnings: collections.Counter = collections.Counter()
    for i in range(args.files):
        width, height = (int(rng.integers(10, 60)) * 8 for _ in range(2))
        data = photo_jpeg(width, height, seed=i % 7)
        bad = damaged(data, rng, i % 3)
        warnings[warning(bad)] += 1
        whole = decode(data).astype(int)
        try:
            got = decode(bad)
        except InvalidImage:
            answers["refused"] += 1
            continue
        wrong = int((np.abs(got.astype(int) - whole).max(axis=(1, 2)) > WRONG_ROW_LEVELS).sum())
        answers["accepted, rows wrong" if wrong else
                 "accepted, the same pixels" if np.array_equal(got, whole) else
                 "accepted, small changes"] += 1
    share = {k: round(v / args.files, 3) for k, v in warnings.most_common()}
    log(f"{args.files} damaged JPEGs: the contract's answers {dict(answers)}")
    log("libjpeg's first warning: " + ", ".join(f"{k}: {v:.0%}" for k, v in share.items()))
    emit({"benchmark": "damaged_jpeg", "files": args.files, "seed": args.seed,
          "answers": dict(answers), "warnings": dict(warnings.most_common()),
          "warning_shares": share, "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
