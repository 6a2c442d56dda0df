"""What the check of a PNG's image data costs: a PNG whose decoded last rows are zero bytes has
its zlib stream counted once more (``model/pixels.py``, ``_png_data_short``: Pillow fills rows a
stream that ends early leaves with zeros, without a word); any other PNG costs nothing more.

    python benchmarks/png_rows.py [--sizes 12 3] [--repeats 5]

Photo-like pictures (``tests/photos.py``) saved as PNG, and the same with their last two rows
black; ``decode`` of each (the server's per-image decode), alternating, medians. The closing
JSON line holds seconds per decode and the black-rows / photo ratio per size.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import numpy as np
from benchlib import alternate, emit, log, machine, median
from PIL import Image
from vit22b.model.pixels import decode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from photos import photo  # noqa: E402  (the pixel tests' photo-like pictures)

SIZES = {12: (4000, 3000), 3: (2000, 1500)}  # megapixels -> (width, height)


def _png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=list(SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    result = {"machine": machine(), "sizes": {}}
    for size in args.sizes:
        width, height = SIZES[size]
        pixels = np.asarray(photo(width, height, seed=1).convert("RGB"))
        black = pixels.copy()
        black[-2:] = 0
        files = {"photo": _png(pixels), "black_last_rows": _png(black)}
        times = alternate({name: lambda data=data, limit=width * height: decode(data, limit)
                           for name, data in files.items()}, args.repeats)
        seconds = {name: median(values) for name, values in times.items()}
        ratio = seconds["black_last_rows"] / seconds["photo"]
        log(f"{size:g} MP PNG ({len(files['photo']) / 1e6:.1f} MB): photo "
            f"{seconds['photo']:.3f} s, last rows black {seconds['black_last_rows']:.3f} s "
            f"({ratio:.2f}x)")
        result["sizes"][f"{size:g}"] = {"seconds": seconds, "black_rows_ratio": round(ratio, 3)}
    emit(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
