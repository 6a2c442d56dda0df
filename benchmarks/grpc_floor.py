"""The floor under the serving path: a no-op gRPC aio call or stream message (3 KB in, 64 B out).

    python benchmarks/grpc_floor.py          # asyncio's loop, then uvloop's, twice each

A ``grpc.aio`` server whose methods return the first 64 request bytes (a unary one, and a
bidirectional stream answering each message) serves on loopback from this process; the clients
run in a separate process, one channel per client, 1 then 32 of them, in four ways: ``unary``
(sync stubs, a thread each, as ``serve.py``'s unary driver), ``stream`` (sync, each client one
stream, a message then its answer), ``aio_unary`` and ``aio_stream`` (the same on grpc.aio, a
task each on one uvloop). Reports calls (messages)/s and the server process's CPU per call: what
any Python gRPC door costs before it does any work. Ends with one JSON line.
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
import asyncio, queue, sys, threading, time, grpc
address, clients, calls, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
payload, per_client = b"x" * 3000, calls // clients

def sync_client(start):
    channel = grpc.insecure_channel(address)
    if mode == "unary":
        call = channel.unary_unary("/floor.Echo/Call")
        send = lambda: call(payload)
    else:
        outbox = queue.Queue()
        answers = channel.stream_stream("/floor.Echo/Stream")(iter(outbox.get, None))
        def send():
            outbox.put(payload)
            next(answers)
    send()  # the connection, off the clock
    start.wait()
    for _ in range(per_client):
        send()
    if mode == "stream":
        outbox.put(None)

async def aio_clients():
    channels = [grpc.aio.insecure_channel(address) for _ in range(clients)]
    if mode == "aio_unary":
        sends = [c.unary_unary("/floor.Echo/Call") for c in channels]
    else:
        streams = [c.stream_stream("/floor.Echo/Stream")() for c in channels]
        async def message(stream):
            await stream.write(payload)
            await stream.read()
        sends = [lambda s=s: message(s) for s in streams]
    if mode == "aio_unary":
        sends = [lambda c=c: c(payload) for c in sends]
    await asyncio.gather(*(send() for send in sends))  # off the clock
    async def run(send):
        for _ in range(per_client):
            await send()
    t0 = time.perf_counter()
    await asyncio.gather(*(run(send) for send in sends))
    return time.perf_counter() - t0

if mode.startswith("aio"):
    import uvloop
    wall = uvloop.run(aio_clients())
else:
    start = threading.Barrier(clients + 1)
    threads = [threading.Thread(target=sync_client, args=(start,)) for _ in range(clients)]
    for thread in threads:
        thread.start()
    start.wait()
    t0 = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - t0
print(per_client * clients / wall, flush=True)
"""
MODES = ("unary", "stream", "aio_unary", "aio_stream")


def process_cpu() -> float:
    with open(f"/proc/{os.getpid()}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def phase(clients: int, calls: int, mode: str) -> dict:
    async def echo(raw: bytes, context) -> bytes:
        return raw[:64]

    async def echo_stream(messages, context):
        async for raw in messages:
            yield raw[:64]

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("floor.Echo", {
        "Call": grpc.unary_unary_rpc_method_handler(echo),
        "Stream": grpc.stream_stream_rpc_method_handler(echo_stream),
    }),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    before = process_cpu()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, f"127.0.0.1:{port}", str(clients), str(calls), mode,
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
            for mode in MODES:
                for clients in (1, 32):
                    with asyncio.Runner(loop_factory=factory) as runner:
                        figures = runner.run(phase(clients, args.calls, mode))
                    results[name].setdefault(f"{mode}_clients_{clients}", []).append(figures)
                    log(f"{name:>8s} server, {mode:>10s} clients x{clients:2d}: {figures}")
    emit({"benchmark": "grpc_floor", "calls": args.calls, **results, "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
