"""This checkout's server against another checkout's, the same clients against both, alternating.

    git worktree add DIR HEAD~1
    python benchmarks/serve_against.py DIR --transport async_session --clients 32

Two ``vit22b serve`` processes (the tiny default model, seeded weights, so both serve the same
model): this checkout's, and ``DIR``'s package laid out ahead of this one on ``PYTHONPATH``
(``sdk_cost.package_of``). ``serve.py``'s client process (this checkout's SDK, one channel per
client, one image per call) drives each in turn, the order flipped every round, so that a
change to the server is measured against the code before it in one run on a drifting host.
Reports per side the median images/s, p50 and average batch, and the median (and range) of the
per-round ratios this / DIR. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading

from benchlib import emit, log, machine, median, percentile
from sdk_cost import package_of
from serve import TRANSPORTS, run_phase


def start(model: str, path: str | None) -> tuple[subprocess.Popen, str, str]:
    """``vit22b serve`` (of the checkout on ``path``, or this one) on free ports, once SERVING;
    returns the process, its address and its metrics URL."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if path:
        env["PYTHONPATH"] = path
    command = [sys.executable, "-m", "vit22b.clients.cli", "serve", "--model", model,
               "--port", "0", "--metrics-port", "0", "--max-batch-images", "32",
               "--max-request-images", "32", "--log-level", "WARNING"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    address = metrics = None
    for line in proc.stdout:
        if found := re.search(r"SERVING .* on (\S+),.*metrics on :(\d+)/metrics", line):
            address, metrics = found[1], f"http://127.0.0.1:{found[2]}/metrics"
            break
    if address is None:
        proc.kill()
        raise RuntimeError(f"vit22b serve ({path or 'this checkout'}) did not report SERVING "
                           "and its metrics address")
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its pipe drained
    return proc, address, metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("against", metavar="DIR", help="another checkout of this project")
    parser.add_argument("--model", default="vit-22b-tiny/16")
    parser.add_argument("--images", type=int, default=2048, help="images per phase")
    parser.add_argument("--size", type=int, default=64, help="side of the JPEG files")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--clients", type=int, nargs="+", default=[32])
    parser.add_argument("--transport", default="async_session", choices=TRANSPORTS)
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.against, "server", "infer.py")):
        parser.error(f"{args.against}: not a checkout of this project")
    args.batch = 32  # run_phase's client process reads it
    with tempfile.TemporaryDirectory() as scratch:
        sides = {"this": start(args.model, None),
                 "against": start(args.model, package_of(args.against, scratch))}
        runs: dict[str, dict[int, list[dict]]] = {n: {c: [] for c in args.clients} for n in sides}
        try:
            for _, address, metrics in sides.values():  # warm: connections, first calls
                run_phase(args, address, metrics, max(args.clients), transport=args.transport)
            for r in range(args.rounds):
                order = list(sides) if r % 2 == 0 else list(reversed(sides))
                for clients in args.clients:
                    for name in order:
                        _, address, metrics = sides[name]
                        runs[name][clients].append(run_phase(args, address, metrics, clients,
                                                             transport=args.transport))
                log(f"round {r + 1}/{args.rounds} done")
        finally:
            for proc, _, _ in sides.values():
                proc.terminate()
            for proc, _, _ in sides.values():
                proc.wait(60)
    result: dict = {}
    for clients in args.clients:
        ratios = [b["wall_s"] / a["wall_s"]
                  for a, b in zip(runs["this"][clients], runs["against"][clients])]
        phase = result[f"clients_{clients}"] = {
            "ratio_this_to_against": round(median(ratios), 3),
            "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)]}
        for name, phases in runs.items():
            done = phases[clients]
            latencies = [v for p in done for v in p["latencies_s"]]
            phase[name] = {
                "images_per_s": round(median([args.images / p["wall_s"] for p in done]), 1),
                "p50_ms": round(1e3 * percentile(latencies, 50), 2),
                **{key: round(median([p[key] for p in done]), 3)
                   for key in ("avg_batch", "compute_busy", "preprocess_ms_per_call")}}
        log(f"{clients} clients: {phase}")
    emit({"benchmark": "serve_against", "against": os.path.abspath(args.against),
          "model": args.model, "transport": args.transport, "images": args.images,
          "rounds": args.rounds, **result, "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
