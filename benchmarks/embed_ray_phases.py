"""Where the Ray runner's fixed cost per job goes: a timeline of one `--runner ray` job.

The same setting as benchmarks/embed_ray.py (a JPEG folder, one `vit22b serve` subprocess, a
Ray instance started before the clocks, server actors), one small job at a time into a fresh
directory, after one warm-up job. Timestamps (one clock: the machine's) from the driver
(wrapped module functions: identity, enumeration, opening the output, the dataset's first and
last rows, recording shards) and from the actors (a subclass of EmbedShards that logs its
process's start, its constructor, and each call, to a file), printed relative to the job's
start. The difference between consecutive marks is the phase's cost; a threads-runner job of
the same size is timed beside it. Also the CPU each side spends per image, by process: this
one (the driver, or the threads runner), the server, the actors, and Ray's own processes
(raylet, GCS, idle workers), from /proc before and after each job (an actor logs its own CPU
at every call's end, since it exits with the job).

    python benchmarks/embed_ray_phases.py --images 1024 --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time

import psutil
from benchlib import emit, load_average, log, median
from embed import write_jpegs
from embed_ray import start_server
from vit22b.clients import embed as embed_module
from vit22b.clients import embed_ray
from vit22b.clients.embed_store import OutputStore

TRACE = os.path.join(tempfile.mkdtemp(prefix="vit22b-ray-phases-"), "actors.jsonl")


def note(event: str, **more) -> None:
    with open(TRACE, "a") as f:
        f.write(json.dumps({"t": time.time(), "event": event, "pid": os.getpid(), **more}) + "\n")


class TimedShards(embed_ray.EmbedShards):
    """EmbedShards that logs when its process started and what its constructor and calls took."""

    def __init__(self, *args, **kwargs):
        note("actor_process_start", at=psutil.Process().create_time())
        note("actor_init_start")
        super().__init__(*args, **kwargs)
        note("actor_init_end")

    def __call__(self, batch):
        note("call_start")
        out = super().__call__(batch)
        note("call_end", cpu=own_cpu(psutil.Process()))
        return out


def own_cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def cpu_snapshot(server_pid: int) -> dict[int, tuple[str, float]]:
    """pid -> (its group, CPU seconds so far) for this process and every process below it."""
    me = psutil.Process()
    out = {}
    for process in [me, *me.children(recursive=True)]:
        try:
            line = " ".join(process.cmdline())
            if process.pid == me.pid:
                group = "driver"
            elif process.pid == server_pid:
                group = "server"
            else:
                group = "actors" if "MapWorker" in line else "ray_system"
            out[process.pid] = (group, own_cpu(process))
        except psutil.Error:  # gone meanwhile
            pass
    return out


def cpu_used(before: dict, after: dict, actors_end: dict[int, float]) -> dict[str, float]:
    """CPU seconds per group between two snapshots; actors that exited, from their own log."""
    used = dict.fromkeys(("driver", "server", "actors", "ray_system"), 0.0)
    for pid, (group, cpu) in after.items():
        used[group] += cpu - before.get(pid, (group, 0.0))[1]
    for pid, cpu in actors_end.items():
        if pid not in after:
            used["actors"] += cpu - before.get(pid, ("", 0.0))[1]
    return used


def instrument(marks: list[tuple[float, str]]) -> None:
    """Wrap the driver's steps so that each logs when it starts and ends."""

    def wrap(owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            marks.append((time.time(), f"{label}_start"))
            try:
                return original(*args, **kwargs)
            finally:
                marks.append((time.time(), f"{label}_end"))

        setattr(owner, name, timed)

    wrap(embed_ray.ServerActors, "identity", "identity")
    wrap(embed_module, "enumerate_inputs", "enumerate")
    wrap(OutputStore, "open", "store_open")
    wrap(OutputStore, "record", "record")
    wrap(OutputStore, "finish", "finish")
    import ray.data

    map_batches = ray.data.Dataset.map_batches

    def timed_map_batches(self, fn, *args, **kwargs):  # the runner's class, logging
        return map_batches(self, TimedShards if fn is embed_ray.EmbedShards else fn, *args,
                           **kwargs)

    ray.data.Dataset.map_batches = timed_map_batches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--size", type=int, default=80)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--shard-size", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--max-delay-ms", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None)
    args = parser.parse_args(argv)

    import ray
    from vit22b.clients.embed import JobConfig, OutputSpec, run_job
    from vit22b.clients.embed_remote import RemoteBackend

    load_before = load_average()
    work = tempfile.mkdtemp(prefix="vit22b-bench-ray-phases-")
    data = os.path.join(work, "data")
    write_jpegs(data, args.images, (args.size, args.size + args.size // 4))
    server, address = start_server(args)
    t0 = time.time()
    ray.init(num_cpus=max(args.concurrency, os.cpu_count() or 1), include_dashboard=False,
             logging_level="WARNING")
    log(f"ray.init: {time.time() - t0:.2f} s")
    marks: list[tuple[float, str]] = []
    instrument(marks)
    spec = OutputSpec()
    runs = iter(range(10**6))

    def config() -> JobConfig:
        return JobConfig([data], os.path.join(work, f"out{next(runs)}"), spec,
                         batch_size=args.batch_size, shard_size=args.shard_size, quiet=True,
                         on_shard=lambda k: marks.append((time.time(), "row")))

    cpu: dict[str, list[dict[str, float]]] = {"threads": [], "ray": []}

    def on_ray() -> dict[str, float]:
        marks.clear()
        open(TRACE, "w").close()
        before = cpu_snapshot(server.pid)
        start = time.time()
        summary = embed_ray.embed_with_ray(config(), embed_ray.ServerActors((address,)),
                                           concurrency=args.concurrency)
        end = time.time()
        assert summary.complete and summary.embedded == args.images, summary
        events = [json.loads(line) for line in open(TRACE)]
        actors_end = {e["pid"]: e["cpu"] for e in events if e["event"] == "call_end"}
        cpu["ray"].append(cpu_used(before, cpu_snapshot(server.pid), actors_end))
        return timeline(start, end, marks, events)

    def threads() -> float:
        backend = RemoteBackend([address], spec, batch_size=args.batch_size,
                                concurrency=args.concurrency, quiet=True)
        before = cpu_snapshot(server.pid)
        start = time.perf_counter()
        try:
            summary = run_job(config(), backend)
        finally:
            backend.close()
        assert summary.complete
        seconds = time.perf_counter() - start
        cpu["threads"].append(cpu_used(before, cpu_snapshot(server.pid), {}))
        return seconds

    try:
        on_ray(), threads()  # warm-up
        results, threads_s = [], []
        for k in range(args.repeats):
            threads_s.append(threads())
            results.append(on_ray())
            log(f"repeat {k}: threads {threads_s[-1]:.2f} s; ray " +
                ", ".join(f"{name} {t:.3f}" for name, t in results[-1].items()))
    finally:
        ray.shutdown()
        server.terminate()
        server.wait(timeout=60)
    phases = {name: round(median([r[name] for r in results]), 3) for name in results[0]}
    emit({
        "benchmark": "embed_ray_phases",
        "images": args.images,
        "shard_size": args.shard_size,
        "batch_size": args.batch_size,
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "threads_s": round(median(threads_s), 3),
        "ray_phases_s": phases,
        "cpu_ms_per_image": {  # the warm-up's excluded; medians over the repeats
            side: {group: round(1e3 * median([r[group] for r in runs[1:]]) / args.images, 3)
                   for group in runs[0]}
            for side, runs in cpu.items()},
        "ray": ray.__version__,
        "load_average_before": load_before,
        "load_average_after": load_average(),
    })
    return 0


def timeline(start: float, end: float, marks: list[tuple[float, str]],
             events: list[dict]) -> dict[str, float]:
    """Seconds since the job's start at each mark (the first of each kind; ``rows_last``)."""
    first: dict[str, float] = {}
    for t, name in sorted(marks):
        first.setdefault(name, t - start)
    rows = [t - start for t, name in marks if name == "row"]
    actor = {}
    for e in sorted(events, key=lambda e: e["t"]):
        actor.setdefault(e["event"], e["t"] - start)
    actor["actor_process_start"] = min(e["at"] for e in events
                                       if e["event"] == "actor_process_start") - start
    return {
        "identity_end": first["identity_end"],
        "enumerate_end": first["enumerate_end"],
        "store_open_end": first["store_open_end"],
        "actor_process_start": actor["actor_process_start"],
        "actor_init_start": actor["actor_init_start"],
        "actor_init_end": actor["actor_init_end"],
        "first_call_start": actor["call_start"],
        "first_call_end": actor["call_end"],
        "first_row": rows[0],
        "last_call_end": max(e["t"] for e in events if e["event"] == "call_end") - start,
        "last_row": rows[-1],
        "finish_end": first["finish_end"],
        "end": end - start,
    }


if __name__ == "__main__":
    sys.exit(main())
