"""What request bodies in flight cost the server: large calls at once, and the same one by one.

    python benchmarks/body_memory.py [--clients 20 40] [--mb 60] [--serial 20]

Starts `vit22b serve` (the embedded tiny model), sends ``--serial`` `Embed` calls one after
another, each one "image" of ``--mb`` MB of random bytes (refused as no image format once
parsed: the cost is the body's alone), then for each ``--clients`` N, N such calls at once.
Reports the server process's peak and current resident memory (VmHWM, VmRSS from /proc) after
each phase. Nothing bounds bodies in flight as a whole (grpcio has no memory quota): the peak
grows with the calls at once, not with the calls over time. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import threading

import grpc
from benchlib import emit, log, machine, serve_process
from vit22b.v1 import features_pb2 as pb

EMBED = "/vit22b.v1.FeatureService/Embed"


def memory_mb(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        text = f.read()
    return {key: int(re.search(rf"{key}:\s+(\d+)", text)[1]) // 1024
            for key in ("VmHWM", "VmRSS")}


def call(address: str, body: bytes, codes: list) -> None:
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)]) as ch:
        try:
            ch.unary_unary(EMBED)(body, timeout=300)
            codes.append("OK")
        except grpc.RpcError as err:
            codes.append(err.code().name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[20, 40])
    parser.add_argument("--mb", type=int, default=60)
    parser.add_argument("--serial", type=int, default=20)
    args = parser.parse_args(argv)
    body = pb.EmbedRequest(images=[pb.Image(id="x", encoded=os.urandom(args.mb << 20))])
    body = body.SerializeToString()
    proc, address = serve_process([])
    phases = []
    try:
        phases.append({"phase": "started", **memory_mb(proc.pid)})
        codes: list = []
        for _ in range(args.serial):  # first: the peak (VmHWM) never comes down
            call(address, body, codes)
        phases.append({"phase": f"{args.serial} one by one", "codes": sorted(set(codes)),
                       **memory_mb(proc.pid)})
        log(str(phases[-1]))
        for n in args.clients:
            codes = []
            threads = [threading.Thread(target=call, args=(address, body, codes))
                       for _ in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            phases.append({"phase": f"{n} at once", "codes": sorted(set(codes)),
                           **memory_mb(proc.pid)})
            log(str(phases[-1]))
    finally:
        proc.terminate()
        proc.wait(60)
    emit({"benchmark": "body_memory", "mb": args.mb, "phases": phases, "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
