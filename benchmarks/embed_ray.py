"""Batch job throughput: `vit22b embed --runner ray` against the threads runner, same run.

Both runners embed the same JPEG folder through the same `vit22b serve` process (a subprocess,
so the server's decoding and forward run beside both clients alike), with the same batch size,
shard size and requests in flight (``--concurrency``: threads per server on one side, actors on
the other), each into a fresh output directory: enumeration, reads, gRPC, shards, checksums and
manifest included on both sides. The Ray side also pays for starting its actor pool, on every
run (Ray Data starts one per job); the Ray instance itself is started once, before the clocks.
Runs alternate (threads, ray, threads, ray, ...) after one warm-up run each; medians compared.

Each side runs two job sizes (``--images`` and ``--small``, the first images of the same
folder through a list file), so its wall time splits into a fixed cost per job and a rate:
``wall = fixed + images / rate`` (the medians of both sizes, solved). The rate is what a long
job sees; the Ray side's fixed cost (Ray Data starting its executor and actor pool, per job) is
``ray_fixed_s``, and ``break_even_images`` the job size at which the end-to-end ratio reaches
the target with these figures.

    python benchmarks/embed_ray.py                 # tiny default model, 80x100 JPEGs
    python benchmarks/embed_ray.py --images 8192 --shard-size 512 --concurrency 4

The last line of stdout is one JSON object: ``ratio_ray_to_threads`` (end to end at
``--images``) and ``ratio_ray_to_threads_rate`` (after the fixed costs) against the target 0.9.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile

from benchlib import alternate, emit, load_average, log, machine, median, serve_process
from embed import write_jpegs


def start_server(args) -> tuple[subprocess.Popen, str]:
    flags = ["--max-batch-images", str(args.batch_size), "--max-delay-ms", str(args.max_delay_ms)]
    return serve_process(flags + (["--model", args.model] if args.model else []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="preset (default: the embedded model)")
    parser.add_argument("--images", type=int, default=8192)
    parser.add_argument("--small", type=int, default=1024, help="the smaller job's images")
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
    paths = write_jpegs(data, args.images, (args.size, args.size + args.size // 4))
    server, address = start_server(args)
    ray.init(num_cpus=max(args.concurrency, os.cpu_count() or 1), include_dashboard=False,
             logging_level="WARNING")
    spec = OutputSpec()
    model = ServerActors((address,)).model_and_limit(spec, args.batch_size)[0].name
    runs = iter(range(10**6))
    small = os.path.join(work, "small.txt")
    with open(small, "w") as f:
        f.write("".join(f"{os.path.relpath(p, work)}\n" for p in sorted(paths)[: args.small]))
    sizes = {"large": ([data], args.images), "small": ([small], args.small)}

    def config(size: str) -> JobConfig:
        return JobConfig(sizes[size][0], os.path.join(work, f"out{next(runs)}"), spec,
                         batch_size=args.batch_size, shard_size=args.shard_size, quiet=True)

    def threads(size: str) -> None:
        backend = RemoteBackend([address], spec, batch_size=args.batch_size,
                                concurrency=args.concurrency, quiet=True)
        try:
            summary = run_job(config(size), backend)
        finally:
            backend.close()
        assert summary.complete and summary.embedded == sizes[size][1], summary

    def on_ray(size: str) -> None:
        summary = embed_with_ray(config(size), ServerActors((address,)),
                                 concurrency=args.concurrency)
        assert summary.complete and summary.embedded == sizes[size][1], summary

    sides = {f"{name}_{size}": functools.partial(fn, size) for size in sizes
             for name, fn in (("threads", threads), ("ray", on_ray))}
    try:
        alternate(sides, 1)  # warm-up: page cache, Ray's worker pool
        times = alternate(sides, args.repeats)
    finally:
        ray.shutdown()
        server.terminate()
        server.wait(timeout=60)
    for k in range(args.repeats):
        log(f"repeat {k}: " + ", ".join(
            f"{side} {sizes[side.split('_')[1]][1] / times[side][k]:.1f} img/s" for side in sides))
    wall = {side: median(t) for side, t in times.items()}
    fit = {}
    for name in ("threads", "ray"):  # wall = fixed + images / rate, from the two sizes
        rate = (args.images - args.small) / (wall[f"{name}_large"] - wall[f"{name}_small"])
        fit[name] = (wall[f"{name}_large"] - args.images / rate, rate)
    threads_ips = args.images / wall["threads_large"]
    ray_ips = args.images / wall["ray_large"]
    target = 0.9
    # the images n from which threads' wall >= target * ray's wall:
    # fixed_t + n / rate_t >= target * (fixed_r + n / rate_r)
    slack = 1 / fit["threads"][1] - target / fit["ray"][1]
    gap = target * fit["ray"][0] - fit["threads"][0]
    break_even = round(gap / slack) if slack > 0 else None  # None: never, at these rates
    emit({
        "benchmark": "embed_ray_vs_threads",
        "model": model,
        "images": args.images,
        "image_size": [args.size, args.size + args.size // 4],
        "batch_size": args.batch_size,
        "shard_size": args.shard_size,
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "threads_images_per_s": round(threads_ips, 1),
        "ray_images_per_s": round(ray_ips, 1),
        "small_images": args.small,
        "seconds": {side: [round(t, 2) for t in ts] for side, ts in times.items()},
        "ratio_ray_to_threads": round(ray_ips / threads_ips, 3),
        "threads_rate_images_per_s": round(fit["threads"][1], 1),
        "ray_rate_images_per_s": round(fit["ray"][1], 1),
        "ratio_ray_to_threads_rate": round(fit["ray"][1] / fit["threads"][1], 3),
        "threads_fixed_s": round(fit["threads"][0], 2),
        "ray_fixed_s": round(fit["ray"][0], 2),
        "break_even_images": break_even,
        "target_ratio": target,
        "ray": ray.__version__,
        "cpu": machine()["cpu"],
        "load_average_before": load_before,
        "load_average_after": load_average(),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
