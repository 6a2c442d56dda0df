"""What the SDK's async session costs its caller per call, next to a bare grpc.aio stream.

    python benchmarks/sdk_cost.py                 # 32 sessions, then 1; two alternating rounds
    python benchmarks/sdk_cost.py --against DIR   # and the session of another checkout
                                                  # (git worktree add DIR REV), alternating

The server here answers every ``EmbedStream`` message with one canned response (recorded once
from the real server: the tiny model's pooled feature of a 64x64 JPEG) and ``GetModelInfo`` with
the real model's info, so no model runs and the clients' cost is all there is to see. The
clients run in a separate process (no jax), one channel each, a task each on one uvloop: ``bare``
writes the recorded request bytes and reads the answer on its own stream; ``session`` calls
``AsyncFeatureClient.session().embed([jpeg])``, building the request and the result as a user's
call does; ``against`` is that call with the SDK of another checkout (its package laid out in
a temporary folder ahead of this one on ``PYTHONPATH``), so two revisions of the SDK are
measured in one run, phases alternating. Reports calls/s and the client process's CPU
microseconds per call (every thread: gRPC's included). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile

import grpc
from benchlib import emit, log, machine
from serve import jpegs

CLIENT = r"""
import asyncio, sys, time
import grpc, uvloop
address, clients, calls, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
jpeg, request = bytes.fromhex(sys.argv[5]), bytes.fromhex(sys.argv[6])
per = calls // clients

async def main():
    if mode == "bare":
        channels = [grpc.aio.insecure_channel(address) for _ in range(clients)]
        streams = [c.stream_stream("/vit22b.v1.FeatureService/EmbedStream")() for c in channels]
        async def one(stream):
            await stream.write(request)
            await stream.read()
        callers = streams
    else:
        from vit22b.clients import AsyncFeatureClient
        callers = []
        for _ in range(clients):
            client = await AsyncFeatureClient(address).__aenter__()
            callers.append(await client.session().__aenter__())
        async def one(session):
            assert (await session.embed([jpeg])).pooled.shape[0] == 1
    await asyncio.gather(*(one(c) for c in callers))  # connections, off the clock
    async def run(caller):
        for _ in range(per):
            await one(caller)
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(run(c) for c in callers))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(per * clients / wall, 1e6 * cpu / (per * clients), flush=True)

uvloop.run(main())
"""
MODES = ("bare", "session")


def recorded() -> tuple[bytes, bytes, bytes, bytes]:
    """(model info, one response, the JPEG, its request) from the real server, serialized."""
    from vit22b.server.cpu_devices import prepare_xla_cpu

    prepare_xla_cpu()
    from vit22b.clients import FeatureClient
    from vit22b.clients.session import _messages
    from vit22b.server.app import BackgroundServer
    from vit22b.server.settings import ServeConfig

    jpeg = jpegs(1, 64)[0]
    config = ServeConfig(mesh="auto", port=0, metrics_port=0)
    with BackgroundServer(config) as server, FeatureClient(server.address) as c:
        info = c.model_info()
        ((request, _, _),) = list(_messages(c, [jpeg], None, None, {}, []))
        response = c._call("Embed", request)
    return (info.SerializeToString(), response.SerializeToString(), jpeg,
            request.SerializeToString())


# Where each part of the package lives in a checkout (pyproject.toml's package-dir).
PACKAGE_DIRS = {"clients": "clients", "model": "model", "probes": "probes",
                "server": "server", "v1": "protos/vit22b/v1"}


def package_of(tree: str, into: str) -> str:
    """A folder holding ``vit22b`` as laid out from the checkout ``tree`` (links)."""
    root = os.path.join(into, "vit22b")
    os.makedirs(root)
    for name, sub in PACKAGE_DIRS.items():
        os.symlink(os.path.join(os.path.abspath(tree), sub), os.path.join(root, name))
    return into


async def phase(canned: tuple, clients: int, calls: int, mode: str,
                path: str | None = None) -> dict:
    info, response, jpeg, request = canned

    async def model_info(raw: bytes, context) -> bytes:
        return info

    async def answer_each(messages, context):
        async for _ in messages:
            yield response

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "vit22b.v1.FeatureService", {
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(model_info),
            "EmbedStream": grpc.stream_stream_rpc_method_handler(answer_each),
        }),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, f"127.0.0.1:{port}", str(clients), str(calls),
        "bare" if mode == "bare" else "session", jpeg.hex(), request.hex(),
        stdout=subprocess.PIPE, env={**os.environ, **({"PYTHONPATH": path} if path else {})})
    out, _ = await proc.communicate()
    await server.stop(None)
    if proc.returncode:
        raise SystemExit(f"the {mode} client process failed")
    rate, cpu = map(float, out.split())
    return {"calls_per_s": round(rate), "client_cpu_us_per_call": round(cpu, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--against", metavar="DIR",
                        help="another checkout whose SDK session is measured too")
    args = parser.parse_args(argv)
    if args.against and not os.path.isfile(os.path.join(args.against, "clients", "session.py")):
        parser.error(f"--against {args.against}: not a checkout of this project")
    canned = recorded()
    results: dict = {}
    modes = (*MODES, "against") if args.against else MODES
    with tempfile.TemporaryDirectory() as scratch:
        paths = {"against": package_of(args.against, scratch)} if args.against else {}
        for _ in range(args.rounds):
            for clients in (32, 1):
                for mode in modes:
                    calls = args.calls if clients > 1 else args.calls // 4
                    figures = asyncio.run(phase(canned, clients, calls, mode, paths.get(mode)))
                    results.setdefault(f"{mode}_clients_{clients}", []).append(figures)
                    log(f"{mode:>8s} x{clients:2d}: {figures}")
    emit({"benchmark": "sdk_cost", "calls": args.calls, "against": args.against, **results,
          "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
