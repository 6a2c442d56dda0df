"""Batch job throughput: `vit22b embed --local` against the engine's own images/s, same run.

Both sides embed the same JPEG files with the same engine (loaded and compiled once, before
any clock starts):
- engine: ``Engine.embed`` on the files' bytes already in memory (decode, preprocess, forward,
  batch by batch): the engine's own in-process images/s;
- job: the `--local` path (LocalBackend + run_job) from the files on disk into a fresh output
  directory: enumeration, reads, shards, checksums, manifest, all included.
Runs alternate (engine, job, engine, job, ...) and the medians are compared. Also reported: the
forward alone on pre-decoded pixels, an upper bound neither side can reach.

    python benchmarks/embed.py                       # tiny default model, 64x64 inputs
    python benchmarks/embed.py --model vit-b/16 --images 64 --batch-size 16 --shard-size 32

The last line of stdout is one JSON object; ``ratio_job_to_engine`` is the figure (target >= 0.9).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from PIL import Image


def write_jpegs(folder: str, count: int, size: tuple[int, int], seed: int = 0) -> list[str]:
    """Photo-like JPEGs (smooth gradients plus noise), about what a dataset's files hold."""
    rng = np.random.default_rng(seed)
    height, width = size
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    paths = []
    for i in range(count):
        phase = rng.uniform(0, 6.28, 3)
        base = np.stack([np.sin(xs / (9 + 3 * c) + ys / 17 + phase[c]) for c in range(3)], -1)
        pixels = (127 + 90 * base + rng.normal(0, 12, base.shape)).clip(0, 255).astype(np.uint8)
        path = os.path.join(folder, f"{i // 100:03d}", f"{i:06d}.jpg")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        Image.fromarray(pixels).save(path, quality=90)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="preset (default: the embedded model)")
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--shard-size", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mesh", default="auto")
    args = parser.parse_args(argv)

    from vit22b.clients.embed import JobConfig, OutputSpec, run_job
    from vit22b.clients.embed_local import LocalBackend
    from vit22b.model import DEFAULT_MODEL
    from vit22b.model.pixels import Preprocessor, decode
    from vit22b.server.engine import Engine

    engine = Engine.load(args.model or DEFAULT_MODEL, mesh=args.mesh,
                         max_batch_images=args.batch_size)
    spec = OutputSpec()
    backend = LocalBackend(spec, engine=engine, concurrency=args.concurrency)
    backend.warm_up()
    cfg = engine.cfg
    side = cfg.preprocess.resize
    work = tempfile.mkdtemp(prefix="vit22b-bench-embed-")
    data = os.path.join(work, "data")
    paths = write_jpegs(data, args.images, (side + side // 4, side + side // 2))
    blobs = [open(p, "rb").read() for p in paths]
    pre = Preprocessor(cfg)
    # what the server hands the engine: uint8 levels (the forward normalises them)
    pixels = np.stack([pre.crop(decode(b, min_side=pre.min_side)) for b in blobs])
    request = backend.request
    step = engine.max_batch_images

    def engine_run() -> float:
        start = time.perf_counter()
        backend.local.embed(blobs, request, solo=True)
        return time.perf_counter() - start

    def forward_run() -> float:
        start = time.perf_counter()
        for i in range(0, len(pixels), step):
            engine.forward(pixels[i : i + step], request)
        return time.perf_counter() - start

    def job_run(k: int) -> float:
        config = JobConfig([data], os.path.join(work, f"out{k}"), spec,
                           batch_size=args.batch_size, shard_size=args.shard_size, quiet=True)
        start = time.perf_counter()
        summary = run_job(config, backend)
        seconds = time.perf_counter() - start
        assert summary.complete and summary.embedded == len(paths), summary
        return seconds

    engine_run(), job_run(-1)  # warm caches (page cache, thread pools), not counted
    engine_s, job_s, forward_s = [], [], []
    for k in range(args.repeats):
        engine_s.append(engine_run())
        job_s.append(job_run(k))
        forward_s.append(forward_run())
        print(f"repeat {k}: engine {len(paths) / engine_s[-1]:.1f} img/s, job "
              f"{len(paths) / job_s[-1]:.1f} img/s, forward only "
              f"{len(paths) / forward_s[-1]:.1f} img/s", file=sys.stderr)
    engine_ips = len(paths) / statistics.median(engine_s)
    job_ips = len(paths) / statistics.median(job_s)
    result = {
        "benchmark": "embed_job_vs_engine",
        "model": cfg.name,
        "mesh": engine.mesh_spec,
        "images": len(paths),
        "image_size": [side + side // 4, side + side // 2],
        "batch_size": args.batch_size,
        "shard_size": args.shard_size,
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "engine_images_per_s": round(engine_ips, 2),
        "job_images_per_s": round(job_ips, 2),
        "forward_only_images_per_s": round(len(paths) / statistics.median(forward_s), 2),
        "ratio_job_to_engine": round(job_ips / engine_ips, 3),
        "target_ratio": 0.9,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
