"""The floor under the serving path: a no-op gRPC aio unary call (3 KB in, 64 B out).

    python benchmarks/grpc_floor.py          # asyncio's loop, then uvloop's, twice each

A ``grpc.aio`` server whose one method returns the first 64 request bytes serves on loopback
from this process; the clients run in a separate process (sync stubs, one channel per client,
as ``serve.py``'s driver), 1 then 32 of them. Reports calls/s and the server process's CPU per
call: what any Python gRPC door costs before it does any work. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys

import grpc
from benchlib import emit, log, machine

CLIENT = r"""
import sys, threading, time, grpc
address, clients, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
payload = b"x" * 3000
start = threading.Barrier(clients + 1)
def run():
    call = grpc.insecure_channel(address).unary_unary("/floor.Echo/Call")
    call(payload)  # the connection, off the clock
    start.wait()
    for _ in range(calls // clients):
        call(payload)
threads = [threading.Thread(target=run) for _ in range(clients)]
for thread in threads:
    thread.start()
start.wait()
t0 = time.perf_counter()
for thread in threads:
    thread.join()
print(calls // clients * clients / (time.perf_counter() - t0), flush=True)
"""


def process_cpu() -> float:
    with open(f"/proc/{os.getpid()}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def phase(clients: int, calls: int) -> dict:
    async def echo(raw: bytes, context) -> bytes:
        return raw[:64]

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "floor.Echo", {"Call": grpc.unary_unary_rpc_method_handler(echo)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    before = process_cpu()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, f"127.0.0.1:{port}", str(clients), str(calls),
        stdout=subprocess.PIPE)
    out, _ = await proc.communicate()
    cpu = process_cpu() - before  # includes the clients' connections and first calls
    await server.stop(None)
    return {"calls_per_s": round(float(out)), "server_cpu_us_per_call": round(1e6 * cpu / calls)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    loops = {"asyncio": asyncio.new_event_loop}
    try:
        import uvloop

        loops["uvloop"] = uvloop.new_event_loop
    except ImportError:
        log("uvloop not installed: asyncio's loop only")
    results: dict = {name: {} for name in loops}
    for _ in range(args.rounds):
        for name, factory in loops.items():
            for clients in (1, 32):
                with asyncio.Runner(loop_factory=factory) as runner:
                    figures = runner.run(phase(clients, args.calls))
                results[name].setdefault(f"clients_{clients}", []).append(figures)
                log(f"{name:>8s}, {clients:2d} clients: {figures}")
    emit({"benchmark": "grpc_floor", "calls": args.calls, **results, "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
