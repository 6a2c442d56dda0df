"""HTTP ``POST /v1/features`` against gRPC ``Embed``: one server, the same JPEGs, one run.

One engine (loaded and compiled before any clock starts) serves both doors from this process
(``--http-port``: the same event loop, batcher and facade); the clients run in separate
processes (no jax), as callers would. At 1 and 32 concurrent clients, every call one image:
- grpc: the SDK, ``FeatureClient.embed([jpeg])`` (one channel per client);
- http: httpx, one keep-alive connection per client, ``{"images": [base64 jpeg]}`` in, the
  pooled tensor decoded from its base64 out (what a JSON caller does).
Each repeat runs every phase once, doors alternating; medians are compared.
``ratio_http_to_grpc_32`` is HTTP's throughput over gRPC's at 32 clients (wanted >= 0.9 for
ViT-B/16), ``ratio_http_to_grpc_1`` the same for one client; the average batch comes from the
server's ``vit22b_batch_images`` metric.

    python benchmarks/serve_http.py --model vit-22b-tiny/16 --size 64 --images 256
    python benchmarks/serve_http.py                     # ViT-B/16 (seeded)

(Not ``http.py``: a script's folder comes first on ``sys.path``, and ``http`` is the standard
library's.) The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys

import numpy as np
from benchlib import emit, log, machine
from serve import (
    jpegs,
    run_client_process,
    run_clients,
    run_header,
    serving_parser,
    summarize,
)

CLIENTS = (1, 32)
DOORS = ("grpc", "http")


def drive(door: str, address: str, clients: int, images: list[bytes]) -> dict:
    """Client side of one phase (see ``serve.run_clients``)."""
    if door == "grpc":
        from vit22b.clients import FeatureClient

        def grpc_call(client, image: bytes) -> None:
            assert client.embed([image]).pooled.shape[0] == 1

        return run_clients(lambda: FeatureClient(address), grpc_call, clients, images)
    import httpx

    def http_call(client, image: bytes) -> None:
        response = client.post("/v1/features", json={"images": [base64.b64encode(image).decode()]})
        response.raise_for_status()
        pooled = response.json()["outputs"]["pooled"]
        rows = np.frombuffer(base64.b64decode(pooled["data"]), "<f4").reshape(pooled["shape"])
        assert rows.shape[0] == 1

    return run_clients(lambda: httpx.Client(base_url=address, timeout=120), http_call, clients,
                       images)


def serve_main(args) -> int:
    from vit22b.server.cpu_devices import prepare_xla_cpu

    prepare_xla_cpu()  # what `vit22b serve` does before jax starts
    from vit22b.server.app import BackgroundServer
    from vit22b.server.engine import Engine
    from vit22b.server.settings import ServeConfig

    engine = Engine.load(args.model, mesh=args.mesh, max_batch_images=args.batch)
    warm_s = engine.warm_up()
    log(f"{engine.cfg.name} on {engine.mesh_spec}, buckets {engine.buckets}, "
        f"compiled in {warm_s:.0f}s")
    config = ServeConfig(
        mesh=args.mesh, port=0, http_port=0, metrics_port=0, max_batch_images=args.batch,
        max_request_images=args.batch, max_delay_ms=args.max_delay_ms,
        batch_wait=args.batch_wait,
    )
    phases: dict[str, list[dict]] = {f"{d}_clients_{c}": [] for c in CLIENTS for d in DOORS}
    with BackgroundServer(config, engine=engine) as server:
        metrics_url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
        addresses = {"grpc": server.address, "http": server.http_url}
        for _ in range(args.repeats):
            for clients in CLIENTS:
                for door in DOORS:
                    command = [
                        sys.executable, __file__, "--drive", door, addresses[door],
                        "--clients", str(clients), "--images", str(args.images),
                        "--size", str(args.size),
                    ]
                    phases[f"{door}_clients_{clients}"].append(
                        run_client_process(command, metrics_url, clients))
    summary = {name: summarize(name, runs, args.images) for name, runs in phases.items()}

    def ratio(clients: int) -> float:
        http, grpc = summary[f"http_clients_{clients}"], summary[f"grpc_clients_{clients}"]
        return round(http["images_per_s"] / grpc["images_per_s"], 3)

    emit({
        **run_header("serve_http", engine, args),
        **summary,
        "ratio_http_to_grpc_1": ratio(1),
        "ratio_http_to_grpc_32": ratio(32),
        "machine": machine(),
    })
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = serving_parser(__doc__.splitlines()[0])
    parser.add_argument("--drive", nargs=2, metavar=("DOOR", "ADDRESS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.drive:
        door, address = args.drive
        result = drive(door, address, args.clients, jpegs(args.images, args.size))
        print(json.dumps(result), flush=True)
        return 0
    return serve_main(args)


if __name__ == "__main__":
    sys.exit(main())
