"""`make demo`: the main job end to end on one machine.

1. `vit22b serve` with the embedded default (tiny ViT-22B-recipe preset, seeded weights) on 8
   emulated CPU devices as a ``data=2,model=4`` mesh;
2. the cue-conflict sample through the client SDK (a first look: shapes, throughput);
3. a generated shapes-world dataset written as PNG files, embedded by the batch job
   (`vit22b embed --server ...`: pooled features and patch tokens of every block);
4. the probes on the stored features: linear, few-shot, kNN, calibration, depth, segmentation,
   and shape bias measured the Geirhos way (a linear head trained on images whose shape and
   texture agree, tested on cue-conflict images where they disagree);
5. a moving-shapes world written as MP4 videos, one through the SDK (``embed_video``) and all
   through `vit22b embed --frames 9`, and the video probe on the stored per-frame features;
6. a summary table; reports (JSON) and figures (PNG) in one output folder.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image
from vit22b.clients import FeatureClient
from vit22b.clients.demo import DEVICES, LAYER, MESH, SAMPLE, sample_images, served, summary
from vit22b.model.config import parse_seed
from vit22b.model.schema import whole_number

from .data import ShapesWorld, shapes_world
from .features import features_from_embed_folder
from .report import summarize
from .runner import ProbeData, probe_data_from_shapes_world, run_probe
from .video_demo import video_step

DENSE_AND_CLASSIFICATION = ("linear", "fewshot", "knn", "calibration", "depth", "segmentation")


def write_world(world: ShapesWorld, folder: Path) -> None:
    """One PNG per image, named by its index (the embed job stores rows by path)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, image in enumerate(world.images):
        Image.fromarray(image).save(folder / f"{i:05d}.png")


def embed_folder(address: str, images: Path, output: Path, layers: str) -> None:
    command = [
        sys.executable, "-m", "vit22b.clients.cli", "embed", str(images),
        "--server", address, "--output", str(output),
        "--outputs", "pooled", "--layers", layers, "--batch-size", "16", "--quiet",
    ]  # fmt: skip
    subprocess.run(command, check=True)


def probe_data(world: ShapesWorld, embeddings: Path) -> ProbeData:
    """Stored features re-aligned with the world's targets by file name (index)."""
    features, paths = features_from_embed_folder(embeddings)
    order = np.argsort([int(Path(p).stem) for p in paths])
    if len(order) != len(world.images):
        expected = len(world.images)
        raise SystemExit(f"demo: {embeddings} holds {len(order)} rows, expected {expected}")
    features = features.take(order)
    return probe_data_from_shapes_world(world, features)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vit22b.probes.demo", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("demo-out"), help="output folder")
    parser.add_argument("--train", type=whole_number, default=960,
                        help="shapes-world images (cues agree)")
    parser.add_argument("--conflict", type=whole_number, default=320, help="cue-conflict images")
    parser.add_argument("--videos", type=whole_number, default=200, help="moving-shapes videos")
    parser.add_argument("--seed", type=parse_seed, default=0)
    args = parser.parse_args(argv)
    out: Path = args.out
    start = time.perf_counter()
    # the demo's embeddings are its own: start them afresh, so a run after an upgrade (another
    # output format or pixel contract) is not refused as a resume of another job
    shutil.rmtree(out / "embeddings", ignore_errors=True)

    print(f"demo: `vit22b serve` (embedded default) on {DEVICES} emulated CPU devices, {MESH}")
    layers = "0,1,2,3"  # every block of the 4-deep default: the dense probes pick among them
    warm = (
        "--warm-outputs", "pooled", "--warm-outputs", f"pooled+patch:{LAYER}",
        "--warm-outputs", f"pooled+patch:{layers}",
    )  # fmt: skip
    paths = sample_images(SAMPLE)  # before the server's minute of start-up
    with served(args=warm) as address:
        with FeatureClient(address) as client:
            info = client.model_info()
            t0 = time.perf_counter()
            result = client.embed(paths, outputs=["pooled"], layers=[LAYER], batch_size=8)
            print("\n" + summary(result, paths, SAMPLE, info, time.perf_counter() - t0) + "\n")

        worlds = {
            "world": shapes_world(args.train, seed=args.seed, texture="matched"),
            "conflict": shapes_world(args.conflict, seed=args.seed + 1, texture="conflict"),
        }
        data = {}
        for name, world in worlds.items():
            write_world(world, out / "data" / name)
            print(f"demo: vit22b embed {out / 'data' / name} ({len(world.images)} images)")
            t0 = time.perf_counter()
            embed_folder(address, out / "data" / name, out / "embeddings" / name, layers)
            rate = len(world.images) / (time.perf_counter() - t0)
            print(f"      {rate:.0f} images/s through the batch job")
            data[name] = probe_data(world, out / "embeddings" / name)
        videos = video_step(address, out, args.videos, args.seed)

    reports = out / "reports"
    lines = []
    for kind in DENSE_AND_CLASSIFICATION:
        t0 = time.perf_counter()
        report = run_probe(kind, data["world"], out_dir=reports, seed=args.seed)
        lines.append((summarize(report), time.perf_counter() - t0))
    t0 = time.perf_counter()
    report = run_probe(
        "shape-bias", data["conflict"], out_dir=reports, seed=args.seed, train=data["world"]
    )
    lines.append((summarize(report), time.perf_counter() - t0))
    t0 = time.perf_counter()
    report = run_probe("video", videos, out_dir=reports, seed=args.seed)
    lines.append((summarize(report), time.perf_counter() - t0))

    print(f"\nprobes on {info.model.name} features ({info.source}; random weights: the figures")
    print("show the pipeline working and the probes beating their trivial baselines)\n")
    for text, seconds in lines:
        print(f"{text}   [{seconds:.1f} s]")
    print(f"\nreports and figures: {reports.resolve()}")
    print(f"demo: done in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
