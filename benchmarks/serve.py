"""The serving path end to end (JPEG in, pooled feature out over gRPC) against the engine, same run.

One engine (loaded and compiled once, before any clock starts) serves on loopback from this
process; the clients run in a separate process (``--drive``, no jax; as callers would), so they
do not share the server's interpreter lock. All sides embed the same JPEG bytes:
- engine: the in-process facade, ``LocalInfer.embed`` of the whole list (decoded in its pool,
  batches of ``--batch``, two in flight); its batch-1 time is ``LocalInfer.embed`` of one image;
- clients: 1, 8 and 32 concurrent clients (one channel each), every call one image
  (``FeatureClient.embed([jpeg])``): throughput, per-call latency p50 / p99, and the average
  batch the server formed, from its Prometheus metrics (``vit22b_batch_images`` sum / count);
  one client is the serial baseline that dynamic batching is compared with; the same again
  for each of ``--transports`` past unary (``session``, ``async_session``: every call a
  message on the client's own SDK session, see ``drive``);
- bulk: one SDK client embedding the whole list (requests of ``max_batch_images``, 4 in flight).
Each repeat runs every client side once, in turn, and the engine runs between every two of them
(and before the first): a side's ratio to the engine is taken, each time it runs, against the
mean of the engine runs just before and just after it (this machine's speed drifts within a run
by more than the levers measured), and the ratios reported are the medians of those paired
ratios (their range beside each side); throughputs and latencies are medians too. Ratios:
``ratio_clients32_to_engine`` (>= 0.9 wanted), ``ratio_batching_to_serial`` (32 clients / 1, >= 3),
``ratio_p50_to_engine_b1_plus_delay`` (one client's p50 over the engine's batch-1 time plus
``max_delay_ms``, <= 1.2), ``ratio_bulk_to_engine``, and per session transport T
``ratio_T_clients32_to_engine`` and ``ratio_T_p50_to_engine_b1_plus_delay``.
``engine_batched_to_batch1`` is what the model itself gains from batching: the engine's
batched images/s over its batch-1 images/s.

    python benchmarks/serve.py                          # ViT-B/16 (seeded), the engine's own plan
    python benchmarks/serve.py --model vit-22b-tiny/16 --size 64 --images 1024

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
from benchlib import emit, log, machine, median, percentile, timed
from PIL import Image

CLIENTS = (1, 8, 32)
TRANSPORTS = ("unary", "session", "async_session")  # see drive()


def jpegs(n: int, size: int, seed: int = 0) -> list[bytes]:
    """Noise JPEGs (the costliest to decode at their size), deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        buffer = io.BytesIO()
        pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


# ---- the client process ----------------------------------------------------------------------


def drive(address: str, clients: int, images: list[bytes], bulk_batch: int,
          transport: str = "unary") -> dict:
    """Client side of one phase: connect and warm up, print 'ready', wait for 'go' on stdin,
    then run; returns wall seconds and per-call latencies. ``clients == 0``: one bulk call.
    ``transport``: each client's calls as unary ``Embed`` calls (``unary``), as messages on
    its own ``FeatureClient.session()`` (``session``, one thread per client) or its own
    ``AsyncFeatureClient.session()`` (``async_session``, one task per client on one loop)."""
    from vit22b.clients import FeatureClient

    if transport == "async_session":
        return drive_async_sessions(address, clients, images)
    if transport == "session":
        @contextlib.contextmanager
        def connect():
            with FeatureClient(address) as client, client.session() as session:
                yield session

        return run_clients(connect, lambda s, image: _one(s.embed([image])), clients, images)

    if clients == 0:
        with FeatureClient(address, concurrency=4) as client:
            client.embed(images[:bulk_batch])
            _handshake()
            wall = timed(lambda: client.embed(images, batch_size=bulk_batch))
        return {"wall_s": wall, "latencies_s": []}

    return run_clients(lambda: FeatureClient(address), lambda c, image: _one(c.embed([image])),
                       clients, images)


def _one(result) -> None:
    assert result.pooled.shape[0] == 1


def drive_async_sessions(address: str, clients: int, images: list[bytes]) -> dict:
    """``run_clients`` as asyncio tasks: each its own client and session, one loop."""
    from vit22b.clients import AsyncFeatureClient

    try:  # the loop the server's doors run on (no jax in this process)
        from uvloop import new_event_loop
    except ImportError:
        new_event_loop = asyncio.new_event_loop

    shares = [images[i::clients] for i in range(clients)]
    latencies: list[float] = []

    async def main() -> float:
        async with contextlib.AsyncExitStack() as stack:
            sessions = []
            for share in shares:
                client = await stack.enter_async_context(AsyncFeatureClient(address))
                sessions.append(await stack.enter_async_context(client.session()))
                _one(await sessions[-1].embed([share[0]]))  # off the clock
            await asyncio.to_thread(_handshake)

            async def calls(session, share: list[bytes]) -> None:
                for image in share:
                    t0 = time.perf_counter()
                    _one(await session.embed([image]))
                    latencies.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            await asyncio.gather(*(calls(s, share) for s, share in zip(sessions, shares)))
            return time.perf_counter() - t0

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        wall = runner.run(main())
    return {"wall_s": wall, "latencies_s": latencies}


def run_clients(connect, call, clients: int, images: list[bytes]) -> dict:
    """``clients`` threads, each with its own connection (``connect()``, a context manager)
    calling ``call(connection, image)`` for every image of its share; the first call off the
    clock, then 'ready' / 'go'. Wall seconds and per-call latencies."""
    shares = [images[i::clients] for i in range(clients)]
    latencies: list[list[float]] = [[] for _ in range(clients)]
    start = threading.Barrier(clients + 1)
    errors: list[BaseException] = []

    def client_loop(i: int) -> None:
        try:
            with connect() as client:
                call(client, shares[i][0])  # connection and first call off the clock
                start.wait()
                for image in shares[i]:
                    t0 = time.perf_counter()
                    call(client, image)
                    latencies[i].append(time.perf_counter() - t0)
        except BaseException as err:  # reported by the parent, never hidden
            errors.append(err)
            start.abort()

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    _handshake()
    start.wait()
    t0 = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return {"wall_s": wall, "latencies_s": [v for per in latencies for v in per]}


def _handshake() -> None:
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("driver: parent went away")


# ---- the server process -----------------------------------------------------------------------


# the server's histograms a phase reads (``server/metrics.py``): their sums and counts
PHASE_METRICS = ("batch_images", "compute_seconds", "queue_seconds", "preprocess_seconds")


def scrape_phase(metrics_url: str) -> dict[str, float]:
    """Sums and counts of ``PHASE_METRICS`` so far, from the server's /metrics endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    names = {f"vit22b_{m}_{part}" for m in PHASE_METRICS for part in ("sum", "count")}
    values = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                values[sample.name] += sample.value
    return values


def phase_figures(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict:
    """What the server did in a phase: its average batch, the share of the wall time its
    compute thread ran forwards, the forward's time per batch, and a call's average time in
    preprocessing (admission to decoded, the decode queue's wait included) and in the queue."""
    d = {k: after[k] - before[k] for k in after}

    def mean_ms(metric: str) -> float:
        count = d[f"vit22b_{metric}_count"]
        return round(1e3 * d[f"vit22b_{metric}_sum"] / count, 3) if count else 0.0

    batches = d["vit22b_batch_images_count"]
    return {
        "avg_batch": d["vit22b_batch_images_sum"] / batches if batches else 0.0,
        "compute_busy": round(d["vit22b_compute_seconds_sum"] / wall_s, 3) if wall_s else 0.0,
        "compute_ms_per_batch": mean_ms("compute_seconds"),
        "preprocess_ms_per_call": mean_ms("preprocess_seconds"),
        "queue_ms_per_job": mean_ms("queue_seconds"),
    }


def run_phase(args, address: str, metrics_url: str, clients: int, on_ready=None,
              on_done=None, transport: str = "unary") -> dict:
    """``serve.py``'s client process for ``clients`` (see ``run_client_process``)."""
    command = [
        sys.executable, __file__, "--drive", address, "--clients", str(clients),
        "--images", str(args.images), "--size", str(args.size), "--batch", str(args.batch),
        "--transport", transport,
    ]
    return run_client_process(command, metrics_url, clients, on_ready, on_done)


def run_client_process(command: list[str], metrics_url: str, clients: int, on_ready=None,
                       on_done=None) -> dict:
    """One client process; returns its figures plus the server's in the phase
    (``phase_figures``: its average batch first).
    ``on_ready(pid)``: called once the clients are connected and warm, before the clock starts;
    ``on_done()`` as soon as they are done (the profiler's hooks)."""
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"client process for {clients} clients did not start")
        if on_ready is not None:
            on_ready(proc.pid)
        before = scrape_phase(metrics_url)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        result = json.loads(proc.stdout.readline())
        if on_done is not None:
            on_done()
        after = scrape_phase(metrics_url)
    finally:
        proc.stdin.close()
        if proc.wait(timeout=60):
            raise RuntimeError(f"client process for {clients} clients failed")
    result.update(phase_figures(before, after, result["wall_s"]))
    return result


def summarize(name: str, phases: list[dict], n: int) -> dict:
    latencies = [v for p in phases for v in p["latencies_s"]]
    out = {
        "images_per_s": round(n / median([p["wall_s"] for p in phases]), 2),
        "avg_batch": round(median([p["avg_batch"] for p in phases]), 2),
    }
    if latencies:
        out["p50_ms"] = round(1e3 * percentile(latencies, 50), 1)
        out["p99_ms"] = round(1e3 * percentile(latencies, 99), 1)
    log(f"{name:>10s}: {out}")
    return out


def serve_main(args) -> int:
    from vit22b.server.cpu_devices import prepare_xla_cpu

    prepare_xla_cpu()  # what `vit22b serve` does before jax starts
    from vit22b.server.app import BackgroundServer
    from vit22b.server.engine import Engine
    from vit22b.server.infer import LocalInfer
    from vit22b.server.settings import ServeConfig

    engine = Engine.load(args.model, mesh=args.mesh, max_batch_images=args.batch)
    warm_s = engine.warm_up()
    images = jpegs(args.images, args.size)
    log(f"{engine.cfg.name} on {engine.mesh_spec}, buckets {engine.buckets}, "
        f"chunks {[engine.plan.chunk_images(b) for b in engine.buckets]}, "
        f"compiled in {warm_s:.0f}s")
    config = ServeConfig(
        mesh=args.mesh, port=0, metrics_port=0, max_batch_images=args.batch,
        max_request_images=args.batch, max_delay_ms=args.max_delay_ms,
        batch_wait=args.batch_wait,
    )
    engine_ips, engine_b1_s = [], []
    phases: dict[str, list[dict]] = {
        phase_name(t, c): [] for t in args.transports for c in CLIENTS
    }
    phases["bulk"] = []
    paired: dict[str, list[float]] = {name: [] for name in phases}  # see pair()
    # The engine side is the in-process facade (decode, batch, forward, finish), the same
    # path the server runs behind its transport.
    with BackgroundServer(config, engine=engine) as server, LocalInfer(engine) as local:
        metrics_url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
        local.embed(images[: args.batch])

        def engine_run() -> None:
            engine_ips.append(args.images / timed(lambda: local.embed(images)))

        def pair(name: str, phase: dict) -> None:
            """The phase beside the engine runs just before and just after it: this machine's
            speed drifts by more than the levers measured within one run."""
            before = engine_ips[-1]
            engine_run()
            phases[name].append(phase)
            paired[name].append(args.images / phase["wall_s"] / ((before + engine_ips[-1]) / 2))

        engine_run()
        for _ in range(args.repeats):
            engine_b1_s.append(median([timed(lambda i=i: local.embed([i])) for i in images[:8]]))
            for transport in args.transports:
                for clients in CLIENTS:
                    pair(phase_name(transport, clients), run_phase(
                        args, server.address, metrics_url, clients, transport=transport))
            pair("bulk", run_phase(args, server.address, metrics_url, 0))
    engine_median = median(engine_ips)
    b1_ms = 1e3 * median(engine_b1_s)
    log(f"    engine: {engine_median:.2f} img/s (range {min(engine_ips):.0f}-"
        f"{max(engine_ips):.0f}), batch-1 {b1_ms:.1f} ms")
    summary = {name: summarize(name, runs, args.images) for name, runs in phases.items()}
    for name, ratios in paired.items():
        summary[name]["ratio_to_engine_range"] = [round(min(ratios), 3), round(max(ratios), 3)]

    def to_engine(name: str) -> float:
        return round(median(paired[name]), 3)

    one, many = summary["clients_1"], summary[f"clients_{CLIENTS[-1]}"]
    per_transport = {}
    for transport in args.transports[1:]:
        one_t = summary[phase_name(transport, 1)]
        per_transport[f"ratio_{transport}_clients32_to_engine"] = to_engine(
            phase_name(transport, CLIENTS[-1]))
        per_transport[f"ratio_{transport}_p50_to_engine_b1_plus_delay"] = round(
            one_t["p50_ms"] / (b1_ms + args.max_delay_ms), 3)
    emit({
        **run_header("serve", engine, args),
        "engine_images_per_s": round(engine_median, 2),
        "engine_images_per_s_range": [round(min(engine_ips), 2), round(max(engine_ips), 2)],
        "engine_batch1_ms": round(b1_ms, 1),
        **summary,
        "ratio_clients32_to_engine": to_engine(f"clients_{CLIENTS[-1]}"),
        "ratio_batching_to_serial": round(many["images_per_s"] / one["images_per_s"], 3),
        "ratio_p50_to_engine_b1_plus_delay": round(
            one["p50_ms"] / (b1_ms + args.max_delay_ms), 3
        ),
        "ratio_bulk_to_engine": to_engine("bulk"),
        **per_transport,
        # what the model itself gains from batching (batching also saves per-call costs)
        "engine_batched_to_batch1": round(engine_median * b1_ms / 1e3, 3),
        "machine": machine(),
    })
    return 0


def phase_name(transport: str, clients: int) -> str:
    return f"clients_{clients}" if transport == "unary" else f"{transport}_clients_{clients}"


def run_header(benchmark: str, engine, args) -> dict:
    """What a serving benchmark's JSON line starts with: the model, mesh and settings."""
    return {
        "benchmark": benchmark,
        "model": engine.cfg.name,
        "mesh": engine.mesh_spec,
        "images": args.images,
        "jpeg_side": args.size,
        "max_batch_images": args.batch,
        "max_delay_ms": args.max_delay_ms,
        "batch_wait": args.batch_wait,
        "repeats": args.repeats,
    }


def serving_parser(description: str) -> argparse.ArgumentParser:
    """The serving benchmarks' options (model, mesh, images, batching, repeats)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="vit-b/16")
    parser.add_argument("--mesh", default="auto", help="default: the engine's own choice")
    parser.add_argument("--images", type=int, default=96, help="images per side and repeat")
    parser.add_argument("--size", type=int, default=256, help="side of the JPEG files")
    parser.add_argument("--batch", type=int, default=32, help="max_batch_images")
    parser.add_argument("--max-delay-ms", type=float, default=5.0)
    parser.add_argument("--batch-wait", default="decoding", help="the server's --batch-wait")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients", type=int, default=1, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = serving_parser(__doc__.splitlines()[0])
    parser.add_argument("--drive", metavar="ADDRESS", help=argparse.SUPPRESS)  # client process
    parser.add_argument("--transport", default="unary", choices=TRANSPORTS,
                        help=argparse.SUPPRESS)  # the client process's calls
    parser.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS,
                        help="the client phases to run (see drive(); unary always runs)")
    args = parser.parse_args(argv)
    if args.drive:
        result = drive(args.drive, args.clients, jpegs(args.images, args.size), args.batch,
                       args.transport)
        print(json.dumps(result), flush=True)
        sys.stdin.read()  # alive until the parent is done with it (a profiler reads its CPU)
        return 0
    args.transports = ["unary"] + [t for t in args.transports if t != "unary"]
    return serve_main(args)


if __name__ == "__main__":
    sys.exit(main())
