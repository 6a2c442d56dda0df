"""What an open, idle gRPC stream costs the server, and the bound on how many there may be.

    python benchmarks/idle_streams.py [--streams 1000]

Starts `vit22b serve` (the embedded tiny model) with ``--max-concurrent-rpcs`` set to the
number of streams, opens that many ``EmbedStream`` calls from this process over connections of
at most ``--per-connection`` streams each, sends one image on each and reads its answer (as a
session does), then leaves them idle. Reports the server process's resident memory before and
with the streams open (from /proc), per stream, and the code a call beyond the bound gets.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import grpc
from benchlib import emit, log, machine, serve_process
from serve import jpegs
from vit22b.v1 import features_pb2 as pb

SERVICE = "/vit22b.v1.FeatureService/"


def resident_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def measure(address: str, pid: int, streams: int, per_connection: int) -> dict:
    request = pb.EmbedRequest(images=[pb.Image(id="0", encoded=jpegs(1, 64)[0])])
    count = -(-streams // per_connection)
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(count)]
    method = {"request_serializer": pb.EmbedRequest.SerializeToString,
              "response_deserializer": pb.EmbedResponse.FromString}
    spare = grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
    embed = spare.unary_unary(SERVICE + "Embed", **method)
    await embed(request, timeout=60)  # the server's buffers for a batch exist before counting
    before = resident_mb(pid)
    calls = [channels[i // per_connection].stream_stream(SERVICE + "EmbedStream", **method)()
             for i in range(streams)]

    async def first_answer(call) -> None:
        await call.write(request)
        assert len((await call.read()).ids) == 1

    start = time.perf_counter()
    await asyncio.gather(*(first_answer(c) for c in calls))
    opened_s = time.perf_counter() - start
    await asyncio.sleep(2)  # idle
    with_streams = resident_mb(pid)
    try:  # every place is taken: one call more, on a connection of its own, is refused
        await embed(request, timeout=20)
        beyond = "OK"
    except grpc.RpcError as err:
        beyond = err.code().name
    for call in calls:
        call.cancel()
    for channel in (*channels, spare):
        await channel.close()
    return {"streams": streams, "opened_s": round(opened_s, 2), "rss_before_mb": round(before, 1),
            "rss_with_streams_mb": round(with_streams, 1),
            "kb_per_stream": round((with_streams - before) * 1024 / streams, 1),
            "call_beyond_the_bound": beyond}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--per-connection", type=int, default=200)
    args = parser.parse_args(argv)
    proc, address = serve_process(["--max-concurrent-rpcs", str(args.streams),
                                   "--max-streams-per-connection", str(args.per_connection)])
    try:
        result = asyncio.run(measure(address, proc.pid, args.streams, args.per_connection))
    finally:
        proc.terminate()
        proc.wait(60)
    log(str(result))
    emit({"benchmark": "idle_streams", **result, "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
