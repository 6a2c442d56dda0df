"""What the sample aspect ratio's resampling changes in a video's features.

    python benchmarks/video_sar.py [--model vit-22b-tiny/16]

Writes three h264 clips of one smooth picture (192x96, random low-frequency colours): stored
squeezed to 128x96 with a 3:2 sample aspect ratio (anamorphic), the picture with square pixels,
and the squeezed frames as if square (what a reader that ignores the SAR sees). Embeds them with
`vit22b embed DIR -o OUT --local --frames 2` (the model's random seeded weights) and reports
the cosine of each clip's temporal mean to the square clip's. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from fractions import Fraction
from pathlib import Path

import numpy as np
from benchlib import emit, log, machine
from PIL import Image
from vit22b.clients.outputs import open_outputs
from vit22b.clients.video import write_video

CLIPS = ("anamorphic", "square", "stored_as_if_square")


def write_clips(folder: Path) -> None:
    rng = np.random.default_rng(0)
    picture = np.asarray(Image.fromarray(rng.integers(0, 255, (6, 12, 3), np.uint8))
                         .resize((192, 96), Image.BICUBIC))
    stored = np.asarray(Image.fromarray(picture).resize((128, 96), Image.BICUBIC))
    write_video(folder / "anamorphic.mp4", np.stack([stored] * 4), fps=8,
                sample_aspect_ratio=Fraction(3, 2))
    write_video(folder / "square.mp4", np.stack([picture] * 4), fps=8)
    write_video(folder / "stored_as_if_square.mp4", np.stack([stored] * 4), fps=8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit-22b-tiny/16")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="vit22b-sar-") as work:
        clips, out = Path(work) / "clips", Path(work) / "out"
        clips.mkdir()
        write_clips(clips)
        subprocess.run([sys.executable, "-m", "vit22b.clients.cli", "embed", str(clips), "-o",
                        str(out), "--local", "--frames", "2", "--model", args.model, "--quiet"],
                       check=True)
        outputs = open_outputs(str(out))
        means = dict(zip((Path(p).stem for p in outputs.ids), outputs["mean.pooled"].numpy()))
    unit = {k: v.astype(np.float64) / np.linalg.norm(v) for k, v in means.items()}
    cosine = {k: round(float(unit[k] @ unit["square"]), 4) for k in CLIPS if k != "square"}
    log(f"cosine to the square clip: {cosine}")
    emit({"benchmark": "video_sar", "model": args.model, "cosine_to_square": cosine,
          "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
