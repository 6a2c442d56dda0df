"""Whether the server's memory or its metrics grow with traffic: a soak of mixed calls.

    python benchmarks/soak.py [--calls 150000] [--threads 8] [--kinds 0-9]

Starts `vit22b serve` (the embedded tiny model) with both doors and its metrics port, and sends
``--calls`` calls from ``--threads`` threads, each call drawn at random from ten kinds (or those
of ``--kinds``): random
bytes as an image, a valid image next to a bad one with ``skip_invalid_images`` and ids up to 3,000
characters, a deadline of 1 ms, a stream cancelled after its first answer, a PNG with five bytes
changed, a valid HTTP request, random bytes as an HTTP body, raw pixels with random dtype, shape
and data, random output kinds / resolutions / dtypes, and plain batches of 1-8 images. Every 15
s it logs the server process's resident memory and the size of its /metrics page; at the end the
outcome of each kind (status code or OK) and whether the server is alive. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

import grpc
import numpy as np
from benchlib import emit, log, machine, serve_process
from idle_streams import resident_mb
from PIL import Image
from vit22b.v1 import features_pb2 as pb
from vit22b.v1 import features_pb2_grpc as pb_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pngs(sizes: list[tuple[int, int]]) -> list[bytes]:
    rng, out = np.random.default_rng(0), []
    for width, height in sizes:
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (height, width, 3), np.uint8)).save(buffer, "PNG")
        out.append(buffer.getvalue())
    return out


class Traffic:
    """The ten kinds of call; ``call(kind, r)`` returns its outcome's name."""

    def __init__(self, grpc_address: str, http_port: int):
        self.stub = pb_grpc.FeatureServiceStub(grpc.insecure_channel(grpc_address))
        self.url = f"http://127.0.0.1:{http_port}/v1/features"
        self.good = pngs([(64, 64), (80, 64), (64, 96)])

    def _post(self, body: bytes) -> None:
        request = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=10).read()

    def _send(self, kind: int, r: random.Random) -> None:
        embed, image = self.stub.Embed, pb.Image(encoded=r.choice(self.good))
        if kind == 0:
            embed(pb.EmbedRequest(images=[pb.Image(encoded=r.randbytes(r.randrange(1, 3000)))]),
                  timeout=10)
        elif kind == 1:
            images = [pb.Image(id="x" * r.randrange(3000), encoded=image.encoded),
                      pb.Image(encoded=b"GIF89a")]
            embed(pb.EmbedRequest(images=images, skip_invalid_images=True, outputs=[1, 3],
                                  patch_layers=[-1]), timeout=10)
        elif kind == 2:
            embed(pb.EmbedRequest(images=[image] * 4), timeout=0.001)
        elif kind == 3:
            answers = self.stub.EmbedStream(iter([pb.EmbedRequest(images=[image])] * 3), timeout=10)
            next(answers)
            answers.cancel()
        elif kind == 4:
            damaged = bytearray(image.encoded)
            for _ in range(5):
                damaged[r.randrange(len(damaged))] = r.randrange(256)
            embed(pb.EmbedRequest(images=[pb.Image(encoded=bytes(damaged))]), timeout=10)
        elif kind == 5:
            data = base64.b64encode(image.encoded).decode()
            self._post(json.dumps({"images": [{"data": data, "id": str(r.random())}]}).encode())
        elif kind == 6:
            self._post(r.randbytes(200))
        elif kind == 7:
            shape = [r.randrange(-2, 70) for _ in range(r.randrange(4))]
            data = r.randbytes(r.randrange(100))
            pixels = pb.Tensor(dtype=r.randrange(6), shape=shape, data=data)
            embed(pb.EmbedRequest(images=[pb.Image(pixels=pixels)]), timeout=10)
        elif kind == 8:
            resolution = r.choice([0, 32, 48, 17, -5])
            embed(pb.EmbedRequest(images=[image], outputs=[r.randrange(-3, 12)],
                                  resolution=resolution, dtype=r.randrange(-1, 6)), timeout=10)
        else:
            embed(pb.EmbedRequest(images=[image] * r.randrange(1, 9), dtype=r.randrange(1, 4)),
                  timeout=10)

    def call(self, kind: int, r: random.Random) -> str:
        try:
            self._send(kind, r)
            return "OK"
        except grpc.RpcError as err:
            return err.code().name
        except urllib.error.HTTPError as err:
            return f"HTTP {err.code}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=150_000)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--kinds", default="0-9", help="the kinds to draw from: 0-9, or e.g. 3,5")
    args = parser.parse_args(argv)
    http_port, metrics_port = free_port(), free_port()
    proc, address = serve_process(["--http-port", str(http_port),
                                   "--metrics-port", str(metrics_port)])
    traffic, outcomes, lock = Traffic(address, http_port), Counter(), threading.Lock()
    numbers = iter(range(args.calls))
    kinds = (list(range(10)) if args.kinds == "0-9"
             else [int(k) for k in args.kinds.split(",")])

    def worker(seed: int) -> None:
        r = random.Random(seed)
        while True:
            with lock:
                if next(numbers, None) is None:
                    return
            kind = r.choice(kinds)
            outcome = traffic.call(kind, r)
            with lock:
                outcomes[f"{kind}:{outcome}"] += 1

    samples = []
    try:
        threads = [threading.Thread(target=worker, args=(s,)) for s in range(args.threads)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads):
            time.sleep(15)
            page = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read()
            samples.append({"s": round(time.perf_counter() - start),
                            "rss_mb": round(resident_mb(proc.pid)), "metrics_bytes": len(page)})
            log(str(samples[-1]))
        alive = proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(60)
    seconds = samples[-1]["s"] if samples else 0
    result = {"benchmark": "soak", "calls": args.calls, "seconds": seconds,
              "alive": alive, "samples": samples, "outcomes": dict(sorted(outcomes.items())),
              "machine": machine()}
    emit(result)
    return 0 if alive else 1


if __name__ == "__main__":
    sys.exit(main())
