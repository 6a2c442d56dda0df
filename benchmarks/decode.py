"""Decoding real photos: decode + resize + normalise per image, full decoding against JPEG DCT
scaling (``Image.draft``, the pixel contract's reduced-size decoding), same run.

Inputs are photo-like JPEGs (``tests/photos.py``: smooth gradients, soft shapes with sharp edges,
fine texture and sensor noise; quality 90, 4:2:0 as cameras write them) at 12 MP (4000x3000),
3 MP (2000x1500) and 0.5 MP (816x612). For each size and model: images/s on one core (one
thread: ``Preprocessor.load``, the server's per-image work), full decoding (``draft=False``) and
reduced-size (the contract), alternating, medians; the model input's difference between the two
(max and mean absolute, in 8-bit levels of the resized crop and in normalised input units), and
for the tiny model the pooled features' relative difference (its engine, seeded weights).
The same photos as HEIC (quality 90 in 512x512 tiles, as phones write them; written by
pillow-heif, decoded by the contract's libheif) are timed beside them: HEIC has no reduced-size
decoding, so this is what a phone's photo costs against its JPEG. Skipped, with a note, where
pillow-heif (the contract's HEIC decoder, and the encoder here) is not installed.

    python benchmarks/decode.py
    python benchmarks/decode.py --sizes 12 --repeats 3 --models vit-22b-tiny/16

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from benchlib import alternate, emit, log, machine, median

SIZES = {12: (4000, 3000), 3: (2000, 1500), 0.5: (816, 612)}  # megapixels -> (width, height)
TINY = "vit-22b-tiny/16"

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from peers import rel_err  # noqa: E402  (the parity tests' measure of agreement)
from photos import heic, photo_jpeg  # noqa: E402  (the pixel tests' photo-like pictures)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=list(SIZES),
                        help="megapixels, among " + ", ".join(map(str, SIZES)))
    parser.add_argument("--models", nargs="+", default=["vit-b/16", TINY])
    parser.add_argument("--images", type=int, default=3, help="different photos per size")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    from vit22b.model.config import get_config
    from vit22b.model.pixels import Preprocessor, decode

    files = {mp: [photo_jpeg(*SIZES[mp], seed=s) for s in range(args.images)] for mp in args.sizes}
    heics = _as_heic(files)
    rows, figures, inputs = [], {}, {}
    for model in args.models:
        pre = Preprocessor(get_config(model))
        for mp, datas in files.items():
            sides = {
                "full": lambda d=datas, pre=pre: [pre.load(b, draft=False) for b in d],
                "draft": lambda d=datas, pre=pre: [pre.load(b) for b in d],
            }
            if heics:
                sides["heic"] = lambda d=heics[mp], pre=pre: [pre.load(b) for b in d]
            for fn in sides.values():
                fn()  # warm-up
            seconds = alternate(sides, args.repeats)
            ips = {k: len(datas) / median(v) for k, v in seconds.items()}
            full = np.stack([pre.load(b, draft=False) for b in datas])
            reduced = np.stack([pre.load(b) for b in datas])
            inputs[(model, mp)] = (full, reduced)
            levels = np.abs(_levels(pre, full) - _levels(pre, reduced))
            row = {
                "model": model, "megapixels": mp, "size": "x".join(map(str, SIZES[mp])),
                "jpeg_kb": round(median([len(b) for b in datas]) / 1024),
                "resize": pre.cfg.preprocess.resize, "crop": pre.cfg.image_size,
                "full_images_per_s": round(ips["full"], 2),
                "draft_images_per_s": round(ips["draft"], 2),
                "ratio_draft_to_full": round(ips["draft"] / ips["full"], 2),
                "decoded_size": "x".join(map(str, decode(datas[0], min_side=pre.min_side)
                                             .shape[1::-1])),
                "max_abs_levels": round(float(levels.max()), 2),
                "mean_abs_levels": round(float(levels.mean()), 3),
                "max_abs_input": round(float(np.abs(full - reduced).max()), 4),
                "mean_abs_input": round(float(np.abs(full - reduced).mean()), 5),
            }
            if heics:
                row["heic_kb"] = round(median([len(b) for b in heics[mp]]) / 1024)
                row["heic_images_per_s"] = round(ips["heic"], 2)
                row["ratio_heic_to_jpeg"] = round(ips["heic"] / ips["draft"], 2)
                log(f"{model} {mp} MP: HEIC {ips['heic']:.2f} img/s "
                    f"(x{row['ratio_heic_to_jpeg']} of its JPEG's, reduced-size)")
            rows.append(row)
            figures[f"ratio_draft_to_full_{model}_{mp}mp"] = row["ratio_draft_to_full"]
            log(f"{model} {mp} MP: full {ips['full']:.2f} img/s, draft {ips['draft']:.2f} img/s "
                f"(x{row['ratio_draft_to_full']}), decoded {row['decoded_size']}, input diff max "
                f"{row['max_abs_levels']} / mean {row['mean_abs_levels']} levels")
    pooled = pooled_differences({k: v for k, v in inputs.items() if k[0] == TINY})
    for row in rows:
        if row["model"] == TINY:
            row["pooled_rel_diff"] = pooled[row["megapixels"]]
    emit({"benchmark": "decode", "repeats": args.repeats, "images": args.images,
          "threads": 1, "rows": rows, **figures, "machine": machine()})
    return 0


def _as_heic(files: dict) -> dict:
    """Megapixels -> the same photos as HEIC files, or {} (with a note) without the codecs."""
    import io

    from PIL import Image

    try:
        import pillow_heif  # noqa: F401  (the contract's decoder, and the writer here)
    except ImportError as err:
        log(f"HEIC skipped: {err}")
        return {}
    return {mp: [heic(Image.open(io.BytesIO(data)).convert("RGB"), quality=90, tile_size=512)
                 for data in datas] for mp, datas in files.items()}


def _levels(pre, normalised: np.ndarray) -> np.ndarray:
    """Model input back to 8-bit levels (x * std + mean) * 255."""
    p = pre.cfg.preprocess
    return (normalised * np.asarray(p.std, np.float32) + np.asarray(p.mean, np.float32)) * 255.0


def pooled_differences(inputs: dict) -> dict:
    """Megapixels -> pooled-feature relative difference, full vs reduced-size decoding."""
    if not inputs:
        return {}
    from vit22b.model.outputs import POOLED
    from vit22b.server.engine import Engine

    engine = Engine.load(TINY, mesh="data=1,model=1", max_batch_images=8)
    outputs = engine.resolve(POOLED)
    out = {}
    for (_, mp), (full, reduced) in inputs.items():
        a = engine.forward(full, outputs)["pooled"]
        b = engine.forward(reduced, outputs)["pooled"]
        out[mp] = float(f"{rel_err(a, b):.2g}")
    engine.close()
    return out


if __name__ == "__main__":
    start = time.perf_counter()
    code = main()
    log(f"decode benchmark: {time.perf_counter() - start:.0f}s")
    sys.exit(code)
