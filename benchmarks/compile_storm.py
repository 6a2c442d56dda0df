"""A compile storm against a warm client: one client's pooled p50, alone and while another
cycles through more output sets than the compiled-forward cache holds.

    python benchmarks/compile_storm.py [--sets 120] [--calls 200]

The server (tiny default model, in this process, `vit22b serve`'s settings otherwise) compiles
new output sets on its compile thread and refuses those beyond the cache; the warm client's
latency should not follow the storm. Ends with one JSON line: p50/p99 alone and during the
storm, and what the storm's calls got (OK, RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import threading
import time

import numpy as np
from benchlib import log, median, percentile
from PIL import Image


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", type=int, default=120, help="output sets the storm cycles")
    parser.add_argument("--calls", type=int, default=200, help="warm client calls per phase")
    args = parser.parse_args(argv)

    from vit22b.server.cpu_devices import prepare_xla_cpu

    prepare_xla_cpu()
    import grpc
    from vit22b.server.app import BackgroundServer
    from vit22b.server.settings import ServeConfig
    from vit22b.v1 import features_pb2 as pb
    from vit22b.v1 import features_pb2_grpc as pb_grpc

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), np.uint8)).save(
        buffer, format="PNG")
    image = pb.Image(encoded=buffer.getvalue())
    config = ServeConfig(port=0, metrics_port=None, compile_cache="off")
    with BackgroundServer(config) as server:
        depth = server.engine.cfg.depth
        warm = pb_grpc.FeatureServiceStub(grpc.insecure_channel(server.address))
        storm = pb_grpc.FeatureServiceStub(grpc.insecure_channel(server.address))
        # every subset of layers is its own output set: more than enough distinct ones
        subsets = [[layer for layer in range(depth) if k >> layer & 1] or [0]
                   for k in range(1, 1 << depth)]
        sets = [(subsets[k % len(subsets)], k // len(subsets) % 2 == 1) for k in range(args.sets)]

        def phase() -> list[float]:
            times = []
            for _ in range(args.calls):
                start = time.perf_counter()
                warm.Embed(pb.EmbedRequest(images=[image]), timeout=600)
                times.append(time.perf_counter() - start)
            return times

        phase()  # warm-up
        alone = phase()
        stop, codes = threading.Event(), {}

        def cycle() -> None:
            k = 0
            while not stop.is_set():
                layers, norm = sets[k % len(sets)]
                request = pb.EmbedRequest(images=[image], patch_layers=layers,
                                          normalize_patches=norm)
                try:
                    storm.Embed(request, timeout=600)
                    code = "OK"
                except grpc.RpcError as err:
                    code = err.code().name
                codes[code] = codes.get(code, 0) + 1
                k += 1

        thread = threading.Thread(target=cycle)
        thread.start()
        during = phase()
        stop.set()
        thread.join()
        compilations = server.engine.compilations
    out = {
        "alone_p50_ms": round(1e3 * median(alone), 2),
        "alone_p99_ms": round(1e3 * percentile(alone, 99), 2),
        "storm_p50_ms": round(1e3 * median(during), 2),
        "storm_p99_ms": round(1e3 * percentile(during, 99), 2),
        "ratio_storm_to_alone_p50": round(median(during) / median(alone), 3),
        "storm_calls": codes,
        "on_demand_compilations": compilations,
    }
    log(f"warm client p50 {out['alone_p50_ms']} ms alone, {out['storm_p50_ms']} ms during the "
        f"storm; storm calls {codes}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
