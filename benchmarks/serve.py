"""Feature service throughput: images/s through gRPC and the SDK against the engine's own, same run.

Both sides embed the same JPEG bytes with the same engine (loaded and compiled once, before any
clock starts):
- engine: ``Engine.embed`` in process (decode, preprocess, forward, batch by batch, one thread);
- served: ``FeatureClient.embed`` against a server on loopback holding that engine (validation,
  the preprocessing pool, dynamic batching, tensors on the wire; client and server share this
  process and its cores).
Runs alternate (engine, served, engine, served, ...) and the medians are compared.

    python benchmarks/serve.py                            # tiny default model, mesh data=2,model=4
    python benchmarks/serve.py --images 512 --concurrency 8

The last line of stdout is one JSON object; ``ratio_served_to_engine`` is the figure.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402
from vit22b.clients import FeatureClient  # noqa: E402
from vit22b.server.app import BackgroundServer, ServeConfig  # noqa: E402
from vit22b.server.engine import Engine  # noqa: E402


def jpegs(n: int, size: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        buffer = io.BytesIO()
        pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--mesh", default="data=2,model=4")
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--size", type=int, default=224, help="side of the JPEG files")
    parser.add_argument("--batch", type=int, default=32, help="max_batch_images")
    parser.add_argument("--concurrency", type=int, default=4, help="SDK requests in flight")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    engine = Engine.load(args.model, mesh=args.mesh, max_batch_images=args.batch)
    engine.warm_up()
    images = jpegs(args.images, args.size)
    config = ServeConfig(
        mesh=args.mesh,
        port=0,
        metrics_port=None,
        max_batch_images=args.batch,
        max_request_images=args.batch,
    )
    with (
        BackgroundServer(config, engine=engine) as server,
        FeatureClient(server.address, concurrency=args.concurrency) as client,
    ):
        engine_s, served_s = [], []
        client.embed(images[: args.batch])  # connection and first-call costs off the clock
        for _ in range(args.repeats):
            engine_s.append(timed(lambda: engine.embed(images)))
            served_s.append(timed(lambda: client.embed(images)))
    engine_ips = args.images / statistics.median(engine_s)
    served_ips = args.images / statistics.median(served_s)
    result = {
        "model": engine.cfg.name,
        "mesh": engine.mesh_spec,
        "images": args.images,
        "jpeg_side": args.size,
        "max_batch_images": args.batch,
        "concurrency": args.concurrency,
        "engine_images_per_s": round(engine_ips, 1),
        "served_images_per_s": round(served_ips, 1),
        "ratio_served_to_engine": round(served_ips / engine_ips, 3),
        "cores": os.cpu_count(),
    }
    print(
        f"engine {engine_ips:.1f} img/s, served {served_ips:.1f} img/s (median of {args.repeats})",
        file=sys.stderr,
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
