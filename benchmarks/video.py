"""Video throughput: videos/s of 16-frame clips through `vit22b embed --local --frames 16`, and
how the time splits between decoding (PyAV, client side) and the model (preprocess + forward).

Clips: seeded moving colour fields written as h264 MP4 (``--clip-frames`` frames at 24 fps,
``--size``), 16 frames sampled from each (the centres of 16 equal segments). With the engine
loaded and compiled before any clock starts, each repeat runs, in turn:
- decode: ``read_clip`` of every clip, one after another (demux + decode + RGB of the chosen
  frames): the decoding cost alone;
- compute: the inference facade (``LocalInfer``, the job's local path) on the already-decoded
  frames, in calls of the job's batch: resize/crop/normalise + forward;
- job: ``run_job`` over the clips (decode in the workers' threads, overlapping the model) into a
  fresh output directory, everything included.
Medians over the repeats. ``decode_share`` = decode / (decode + compute), the serial split.

    python benchmarks/video.py                        # tiny default model, 32 clips
    python benchmarks/video.py --clips 64 --clip-frames 96 --size 640x360

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import numpy as np
from benchlib import emit, load_average, log, machine, timed


def write_clips(folder: str, count: int, frames: int, size: tuple[int, int]) -> list[str]:
    """Smooth moving colour fields with a little noise (codec-friendly, not trivial to code)."""
    from vit22b.clients.video import write_video

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    height, width = size
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    paths = []
    for i in range(count):
        phase, speed = rng.uniform(0, 6.28, 3), rng.uniform(0.5, 2.0)
        clip = np.empty((frames, height, width, 3), np.uint8)
        for t in range(frames):
            base = np.stack([np.sin((xs + speed * 4 * t) / (19 + 5 * c) + ys / 23 + phase[c])
                             for c in range(3)], -1)
            noise = rng.normal(0, 6, base.shape)
            clip[t] = (127 + 90 * base + noise).clip(0, 255).astype(np.uint8)
        path = os.path.join(folder, f"{i:05d}.mp4")
        write_video(path, clip, fps=24)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="preset (default: the embedded model)")
    parser.add_argument("--clips", type=int, default=32)
    parser.add_argument("--frames", type=int, default=16, help="frames sampled per clip")
    parser.add_argument("--clip-frames", type=int, default=48, help="frames in each clip")
    parser.add_argument("--size", default="320x240", help="WIDTHxHEIGHT of the clips")
    parser.add_argument("--batch-size", type=int, default=32, help="frames per request")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mesh", default="auto")
    args = parser.parse_args(argv)
    width, height = (int(v) for v in args.size.lower().split("x"))

    from vit22b.clients.embed import JobConfig, OutputSpec, run_job
    from vit22b.clients.embed_local import LocalBackend
    from vit22b.clients.video import Sampling, probe, read_clip
    from vit22b.model import DEFAULT_MODEL
    from vit22b.server.engine import Engine

    engine = Engine.load(args.model or DEFAULT_MODEL, mesh=args.mesh,
                         max_batch_images=args.batch_size)
    spec = OutputSpec()
    backend = LocalBackend(spec, engine=engine, concurrency=args.concurrency)
    backend.warm_up()
    work = tempfile.mkdtemp(prefix="vit22b-bench-video-")
    data = os.path.join(work, "clips")
    log(f"writing {args.clips} clips of {args.clip_frames} frames, {width}x{height}")
    paths = write_clips(data, args.clips, args.clip_frames, (height, width))
    info = probe(paths[0])
    sampling = Sampling(frames=args.frames)
    frames = [f for p in paths for f in read_clip(p, sampling).frames]
    step = args.batch_size

    def decode() -> None:
        for path in paths:
            read_clip(path, sampling)

    def compute() -> None:
        for i in range(0, len(frames), step):
            backend.local.embed(frames[i : i + step], backend.request, solo=True)

    def job(k: int) -> None:
        config = JobConfig([data], os.path.join(work, f"out{k}"), spec,
                           batch_size=max(1, step // args.frames), quiet=True, video=sampling)
        summary = run_job(config, backend)
        assert summary.complete and summary.embedded == len(paths), summary

    load_before = load_average()
    decode(), compute(), job(-1)  # warm caches and thread pools, not counted
    times: dict[str, list[float]] = {"decode": [], "compute": [], "job": []}
    for k in range(args.repeats):
        times["decode"].append(timed(decode))
        times["compute"].append(timed(compute))
        times["job"].append(timed(lambda k=k: job(k)))
        log(f"repeat {k}: " + ", ".join(f"{name} {len(paths) / t[-1]:.1f} videos/s"
                                        for name, t in times.items()))
    seconds = {name: statistics.median(t) for name, t in times.items()}
    emit({
        "benchmark": "video",
        "model": engine.cfg.name,
        "mesh": engine.mesh_spec,
        "clips": len(paths),
        "clip": {"frames": info.frame_count, "fps": info.fps, "codec": info.codec,
                 "width": info.width, "height": info.height},
        "frames_per_clip": args.frames,
        "batch_size": step,
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "decode_videos_per_s": round(len(paths) / seconds["decode"], 2),
        "compute_videos_per_s": round(len(paths) / seconds["compute"], 2),
        "job_videos_per_s": round(len(paths) / seconds["job"], 2),
        "job_frames_per_s": round(len(paths) * args.frames / seconds["job"], 1),
        "decode_ms_per_video": round(1000 * seconds["decode"] / len(paths), 2),
        "compute_ms_per_video": round(1000 * seconds["compute"] / len(paths), 2),
        "decode_share": round(seconds["decode"] / (seconds["decode"] + seconds["compute"]), 3),
        "machine": {**machine(), "load_avg_before": load_before},
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
