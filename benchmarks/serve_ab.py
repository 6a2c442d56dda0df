"""Two server settings side by side in one run: single-image clients against each, alternating.

    python benchmarks/serve_ab.py --side decoding:batch_wait=decoding --side delay:batch_wait=delay
    python benchmarks/serve_ab.py --side asyncio: --side uvloop:loop=uvloop

A side names ``ServeConfig`` fields, or attributes of the running server's parts
(``infer.NAME``, ``batcher.NAME``: a lever's switch) set after it started, or
``loop=uvloop`` (the server's event loop).

One engine (the tiny model by default, compiled once) serves behind one server per side, each
with its ``ServeConfig`` overrides; every round runs each phase (1, 8, 32 clients: ``serve.py``'s
client process, one channel per client, one image per call) against every side in turn, the
order flipped each round, so that the sides share the machine's load. Reports per side the median
images/s, p50 and average batch, and per phase the median of the per-round ratios of each side
to the first (and their range). The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import dataclasses
import importlib
import sys

from benchlib import emit, log, machine, median, percentile
from serve import TRANSPORTS, run_phase

CLIENTS = (1, 8, 32)


def parse_side(text: str) -> tuple[str, dict[str, str]]:
    name, _, spec = text.partition(":")
    pairs = [p.split("=", 1) for p in spec.split(",") if p]
    return name, {k: v for k, v in pairs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", action="append", required=True, type=parse_side,
                        help="NAME:setting=value,... (ServeConfig fields, or part.attribute)")
    parser.add_argument("--model", default="vit-22b-tiny/16")
    parser.add_argument("--images", type=int, default=512, help="images per phase")
    parser.add_argument("--size", type=int, default=64, help="side of the JPEG files")
    parser.add_argument("--batch", type=int, default=32, help="max_batch_images")
    parser.add_argument("--max-delay-ms", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--clients", type=int, nargs="+", default=list(CLIENTS))
    parser.add_argument("--transport", default="unary", choices=TRANSPORTS,
                        help="the clients' calls (serve.py's drive)")
    args = parser.parse_args(argv)

    from vit22b.server.cpu_devices import prepare_xla_cpu

    prepare_xla_cpu()
    from vit22b.server.app import BackgroundServer
    from vit22b.server.engine import Engine
    from vit22b.server.settings import ServeConfig

    engine = Engine.load(args.model, mesh="auto", max_batch_images=args.batch)
    engine.warm_up()
    types = {f.name: f.type for f in dataclasses.fields(ServeConfig)}
    servers = {}
    for name, overrides in args.side:
        config = ServeConfig(mesh="auto", port=0, metrics_port=0, max_batch_images=args.batch,
                             max_request_images=args.batch, max_delay_ms=args.max_delay_ms)
        loop = asyncio.new_event_loop
        for key, value in overrides.items():
            if key == "loop":  # the server's event loop: asyncio's or uvloop's
                loop = asyncio.new_event_loop if value == "asyncio" else \
                    importlib.import_module(value).new_event_loop
                continue
            if "." in key:
                continue
            kind = types[key] if isinstance(types[key], str) else types[key].__name__
            setattr(config, key, float(value) if kind.startswith("float") else
                    int(value) if kind.startswith("int") else value)
        servers[name] = BackgroundServer(config, engine=engine, loop_factory=loop).start()
        for key, value in overrides.items():  # a lever's switch: `part.attribute=literal`
            if "." in key:
                part, attribute = key.split(".", 1)
                target = getattr(servers[name].server, part)
                getattr(target, attribute)  # an existing attribute only
                setattr(target, attribute, ast.literal_eval(value))
    runs: dict[str, dict[int, list[dict]]] = {n: {c: [] for c in args.clients} for n in servers}
    try:
        for side in servers.values():  # warm: connections, first calls
            url = f"http://127.0.0.1:{side.server.metrics_port}/metrics"
            run_phase(args, side.address, url, max(args.clients), transport=args.transport)
        for r in range(args.rounds):
            order = list(servers) if r % 2 == 0 else list(reversed(servers))
            for clients in args.clients:
                for name in order:
                    side = servers[name]
                    url = f"http://127.0.0.1:{side.server.metrics_port}/metrics"
                    runs[name][clients].append(run_phase(args, side.address, url, clients,
                                                         transport=args.transport))
            log(f"round {r + 1}/{args.rounds} done")
    finally:
        for side in servers.values():
            side.stop()
    first = next(iter(servers))
    ratios = {n: {c: [q["wall_s"] / p["wall_s"] for p, q in zip(done, runs[first][c])]
                  for c, done in phases.items()} for n, phases in runs.items()}
    result: dict = {}
    for name, phases in runs.items():
        result[name] = {}
        for clients, done in phases.items():
            lat = [v for p in done for v in p["latencies_s"]]
            result[name][f"clients_{clients}"] = {
                "images_per_s": round(median([args.images / p["wall_s"] for p in done]), 1),
                "p50_ms": round(1e3 * percentile(lat, 50), 2),
                "avg_batch": round(median([p["avg_batch"] for p in done]), 2),
                f"ratio_to_{first}": round(median(ratios[name][clients]), 3),
                "ratio_range": [round(min(ratios[name][clients]), 3),
                                round(max(ratios[name][clients]), 3)],
            }
        log(f"{name:>12s}: {result[name]}")
    emit({"benchmark": "serve_ab", "model": args.model, "images": args.images,
          "jpeg_side": args.size, "max_delay_ms": args.max_delay_ms, "rounds": args.rounds,
          "sides": {n: o for n, o in args.side}, **result, "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
