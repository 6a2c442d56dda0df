"""Mutated HEIC files against the pixel contract's HEIC decoder: decoded, refused, or crashed.

libheif and libde265 are C: a file that crashes them ends the server's process, so every
decode here runs in child processes, each taking the files from where the last one stopped; a
child that dies names the file it was decoding, and the next child goes on after it. Seeds are
HEICs written by pillow-heif's encoder: RGB at odd and even sizes, RGBA, grey, 900x700, 512x512
tiles, an irot box with an Exif item, and two images with the second primary. Each mutation is
1-8 random bytes, a truncation, 1-64 inserted bytes, or a 4-byte field set to an extreme, in
turn by a seeded generator.

    python benchmarks/heic_fuzz.py --files 10000 --seed 1
    python benchmarks/heic_fuzz.py --decoder pi_heif   # the decode-only build, where installed

``--decoder`` names the module registered as the contract's plugin (``pi_heif`` has
pillow-heif's API). The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from benchlib import emit, log, machine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from photos import heic  # noqa: E402  (the pixel tests' HEIC writer)

CHILD = """
import json, sys
decoder = __import__(sys.argv[2])
sys.modules["pillow_heif"] = decoder  # the contract registers whatever this name holds
from vit22b.model.errors import InvalidImage
from vit22b.model.pixels import Image, _heif_reader, decode
assert _heif_reader() and Image.OPEN["HEIF"][0].__module__.startswith(sys.argv[2])
folder, start = sys.argv[1], int(sys.argv[3])
files = sorted(__import__("pathlib").Path(folder).glob("*.heic"))
for path in files[start:]:
    print(json.dumps({"file": path.name}), flush=True)
    try:
        decode(path.read_bytes())
        print(json.dumps({"outcome": "decoded"}), flush=True)
    except InvalidImage:
        print(json.dumps({"outcome": "refused"}), flush=True)
    except Exception as err:
        print(json.dumps({"outcome": "error " + type(err).__name__}), flush=True)
"""


def seeds() -> list[bytes]:
    from PIL import Image

    rng = np.random.default_rng(0)

    def picture(height, width, channels=3):
        shape = (height, width, channels) if channels > 1 else (height, width)
        return Image.fromarray(rng.integers(0, 256, shape, np.uint8))

    turned = picture(60, 80)
    exif = Image.Exif()
    exif[0x0112] = 6
    turned.info["exif"] = exif.tobytes()
    return [heic(picture(48, 64), quality=50), heic(picture(37, 50), quality=50),
            heic(picture(64, 64, 4), quality=50), heic(picture(40, 40, 1), quality=50),
            heic(picture(700, 900), quality=50), heic(picture(300, 420), quality=40,
                                                      tile_size=128),
            heic(turned, quality=40),
            heic(picture(40, 40), picture(30, 50), quality=40, primary_index=1)]


def mutated(data: bytes, rng: np.random.Generator, kind: int) -> bytes:
    out = bytearray(data)
    if kind == 0:
        for at in rng.integers(0, len(out), rng.integers(1, 9)):
            out[at] = rng.integers(0, 256)
    elif kind == 1:
        out = out[: rng.integers(1, len(out))]
    elif kind == 2:
        at = int(rng.integers(0, len(out)))
        out[at:at] = rng.bytes(int(rng.integers(1, 65)))
    else:
        at = int(rng.integers(8, len(out) - 4))
        out[at : at + 4] = (b"\xff\xff\xff\xff", b"\x00\x00\x00\x00", b"\x7f\xff\xff\xff",
                            b"\x00\x00\x00\x01")[int(rng.integers(0, 4))]
    return bytes(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--decoder", default="pillow_heif", choices=["pillow_heif", "pi_heif"])
    args = parser.parse_args(argv)
    decoder = __import__(args.decoder)
    rng = np.random.default_rng(args.seed)
    base = seeds()
    outcomes: collections.Counter = collections.Counter()
    crashes = []
    with tempfile.TemporaryDirectory() as folder:
        for k in range(args.files):
            data = mutated(base[k % len(base)], rng, int(rng.integers(0, 4)))
            Path(folder, f"{k:06d}.heic").write_bytes(data)
        start = 0
        while start < args.files:
            child = subprocess.run([sys.executable, "-c", CHILD, folder, args.decoder,
                                    str(start)], capture_output=True, text=True)
            lines = [json.loads(line) for line in child.stdout.splitlines()]
            names = [line["file"] for line in lines if "file" in line]
            outcomes.update(line["outcome"] for line in lines if "outcome" in line)
            start += len(names)
            if child.returncode != 0:
                if not names:  # died before its first file: not a decoder's crash
                    raise SystemExit(f"the child failed: {child.stderr[-2000:]}")
                crashes.append({"file": names[-1], "returncode": child.returncode,
                                "seed_kind": int(names[-1][:6]) % len(base)})
                outcomes["crashed"] += 1
                log(f"crash on {names[-1]} (exit {child.returncode})")
    version = getattr(decoder, "libheif_info", lambda: {})().get("libheif", "?")
    log(f"{args.decoder} (libheif {version}): {dict(outcomes)}")
    emit({"benchmark": "heic_fuzz", "decoder": args.decoder, "libheif": version,
          "files": args.files, "seed": args.seed, "outcomes": dict(outcomes),
          "crashes": crashes, "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
