"""What answers their clients do not read cost the server, under ``--max-unread-mb``.

    python benchmarks/unread_memory.py [--calls 100] [--bound-mb 200] [--images 256]
                                       [--connections 4]

Starts `vit22b serve` (the embedded tiny model) with ``--max-unread-mb BOUND``, measures one
answer (``--images`` 16x16 images, pooled features and patch tokens at four layers, float32)
on a channel that reads it, then opens ``--calls`` such calls, in turn on ``--connections``
channels (a connection each: one holds at most half the bound) whose calls take 64 KiB of an
answer until it is read (no BDP growth) and read none: each computed answer stays in the
server. Once the server's CPU time stops growing, reports the calls refused by the
bound, those ended otherwise (a full queue), the answers held (the others) and their bytes,
and the server's resident memory (VmRSS, VmHWM from /proc) against its start: the bytes the
process holds per answer byte counted. Then closes those channels and reports the memory after
and whether a normal call is served. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import sys
import time

import grpc
import numpy as np
from benchlib import emit, log, machine, serve_process
from body_memory import memory_mb
from vit22b.v1 import features_pb2 as pb
from vit22b.v1 import wire

EMBED = "/vit22b.v1.FeatureService/Embed"
LAYERS = [0, 1, 2, 3]


def request(images: int) -> bytes:
    rng = np.random.default_rng(0)
    return pb.EmbedRequest(
        images=[pb.Image(pixels=wire.to_tensor(rng.integers(0, 256, (16, 16, 3), np.uint8)))
                for _ in range(images)],
        outputs=[pb.OUTPUT_KIND_POOLED], patch_layers=LAYERS).SerializeToString()


def cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def settle(pid: int, quiet_s: float = 2.0, limit_s: float = 300.0) -> None:
    """Until the server's CPU time stops growing for ``quiet_s``."""
    end, last, since = time.monotonic() + limit_s, cpu_ticks(pid), time.monotonic()
    while time.monotonic() < end:
        time.sleep(0.25)
        now = cpu_ticks(pid)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--bound-mb", type=float, default=200.0)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--connections", type=int, default=4)
    args = parser.parse_args(argv)
    body = request(args.images)
    proc, address = serve_process(["--max-unread-mb", str(args.bound_mb)])
    big = [("grpc.max_receive_message_length", 64 << 20)]
    try:
        with grpc.insecure_channel(address, big) as reading:
            answer = reading.unary_unary(EMBED)(body, timeout=120)
        settle(proc.pid)
        start = memory_mb(proc.pid)
        log(f"started: {start}; one answer {len(answer)} bytes")
        held = [grpc.insecure_channel(address, [
            *big, ("grpc.http2.lookahead_bytes", 1 << 16), ("grpc.http2.bdp_probe", 0),
            ("grpc.use_local_subchannel_pool", 1)]) for _ in range(args.connections)]
        calls = []
        for i in range(args.calls):  # paced: the queue's room is not what is measured
            channel = held[i % len(held)]
            calls.append(channel.stream_stream(EMBED)(iter([body]), timeout=600))
            time.sleep(0.05)
        settle(proc.pid)
        ended = [c for c in calls if c.done()]
        refused = sum("--max-unread-mb" in (c.details() or "") for c in ended)
        other = sorted({f"{c.code().name}: {(c.details() or '')[:40]}" for c in ended
                        if "--max-unread-mb" not in (c.details() or "")})  # e.g. queue full
        holding = args.calls - sum(c.done() for c in calls)
        during = memory_mb(proc.pid)
        held_mb = holding * len(answer) / 2**20
        grown = during["VmHWM"] - start["VmRSS"]
        result = {"calls": args.calls, "connections": args.connections,
                  "refused_by_bound": refused, "ended_otherwise": other,
                  "answers_held": holding, "answer_bytes": len(answer),
                  "held_mib": round(held_mb, 1), "bound_mib": args.bound_mb,
                  "start": start, "during": during,
                  "process_mb_per_held_mb": round(grown / held_mb, 2) if held_mb else None}
        log(str(result))
        for channel in held:
            channel.close()
        settle(proc.pid)
        with grpc.insecure_channel(address, big) as reading:
            served = len(pb.EmbedResponse.FromString(
                reading.unary_unary(EMBED)(body, timeout=120)).ids) == args.images
        result |= {"after_close": memory_mb(proc.pid), "served_after": served}
        log(str(result))
    finally:
        proc.terminate()
        proc.wait(60)
    emit({"benchmark": "unread_memory", **result, "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
