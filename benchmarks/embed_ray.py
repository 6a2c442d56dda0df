"""Batch job throughput: `vit22b embed --runner ray` against the threads runner, same run.

Both runners embed the same JPEG folder through the same `vit22b serve` process (a subprocess,
so the server's decoding and forward run beside both clients alike), with the same batch size,
shard size and requests in flight (``--concurrency``: threads per server on one side, actors on
the other), each into a fresh output directory: enumeration, reads, gRPC, shards, checksums and
manifest included on both sides. The Ray side also pays for starting its actor pool, on every
run (Ray Data starts one per job); the Ray instance itself is started once, before the clocks.
Runs alternate (threads, ray, threads, ray, ...) after one warm-up run each; medians compared.

    python benchmarks/embed_ray.py                 # tiny default model, 64x64-ish JPEGs
    python benchmarks/embed_ray.py --images 8192 --shard-size 512 --concurrency 4

The last line of stdout is one JSON object; ``ratio_ray_to_threads`` is the figure (target 0.9).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

from benchlib import alternate, emit, load_average, log, machine, median
from embed import write_jpegs


def start_server(args) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "vit22b.clients.cli", "serve", "--port", "0",
               "--metrics-port", "-1", "--max-batch-images", str(args.batch_size),
               "--max-delay-ms", str(args.max_delay_ms), "--log-level", "WARNING"]
    if args.model:
        command += ["--model", args.model]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        match = re.search(r"SERVING .* on (\S+),", line)
        if match:
            return proc, match[1]
    raise RuntimeError("the server did not report SERVING")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="preset (default: the embedded model)")
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--size", type=int, default=80, help="JPEG side (about)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--shard-size", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--max-delay-ms", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    import ray
    from vit22b.clients.embed import JobConfig, OutputSpec, run_job
    from vit22b.clients.embed_ray import ServerActors, embed_with_ray
    from vit22b.clients.embed_remote import RemoteBackend

    load_before = load_average()
    work = tempfile.mkdtemp(prefix="vit22b-bench-embed-ray-")
    data = os.path.join(work, "data")
    write_jpegs(data, args.images, (args.size, args.size + args.size // 4))
    server, address = start_server(args)
    ray.init(num_cpus=max(args.concurrency, os.cpu_count() or 1), include_dashboard=False,
             logging_level="WARNING")
    spec = OutputSpec()
    runs = iter(range(10**6))

    def config() -> JobConfig:
        return JobConfig([data], os.path.join(work, f"out{next(runs)}"), spec,
                         batch_size=args.batch_size, shard_size=args.shard_size, quiet=True)

    def threads() -> None:
        backend = RemoteBackend([address], spec, batch_size=args.batch_size,
                                concurrency=args.concurrency, quiet=True)
        try:
            summary = run_job(config(), backend)
        finally:
            backend.close()
        assert summary.complete and summary.embedded == args.images, summary

    def on_ray() -> None:
        summary = embed_with_ray(config(), ServerActors((address,)),
                                 concurrency=args.concurrency)
        assert summary.complete and summary.embedded == args.images, summary

    try:
        alternate({"threads": threads, "ray": on_ray}, 1)  # warm-up: page cache, worker pool
        times = alternate({"threads": threads, "ray": on_ray}, args.repeats)
    finally:
        ray.shutdown()
        server.terminate()
        server.wait(timeout=60)
    for k in range(args.repeats):
        log(f"repeat {k}: threads {args.images / times['threads'][k]:.1f} img/s, "
            f"ray {args.images / times['ray'][k]:.1f} img/s")
    threads_ips = args.images / median(times["threads"])
    ray_ips = args.images / median(times["ray"])
    emit({
        "benchmark": "embed_ray_vs_threads",
        "model": args.model or "default",
        "images": args.images,
        "image_size": [args.size, args.size + args.size // 4],
        "batch_size": args.batch_size,
        "shard_size": args.shard_size,
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "threads_images_per_s": round(threads_ips, 1),
        "ray_images_per_s": round(ray_ips, 1),
        "threads_s": [round(t, 2) for t in times["threads"]],
        "ray_s": [round(t, 2) for t in times["ray"]],
        "ratio_ray_to_threads": round(ray_ips / threads_ips, 3),
        "target_ratio": 0.9,
        "ray": ray.__version__,
        "cpu": machine()["cpu"],
        "load_average_before": load_before,
        "load_average_after": load_average(),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
