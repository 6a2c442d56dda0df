"""The memory a compiled forward needs beside its parameters, by XLA's own account.

    python benchmarks/activation_memory.py [--models vit-22b-tiny/16 vit-b/16] [--max-batch 64]

For each model (seeded weights, float32, mesh data=2,model=1 on 2 emulated CPU devices), the
engine's forward for each batch bucket is lowered and compiled, and XLA's memory analysis of
it read: temporary buffers and arguments per device. The plan's chunks bound a step's
activations, so the temporaries stop growing with the batch. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import sys

from benchlib import emit, log, machine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["vit-22b-tiny/16", "vit-b/16"])
    parser.add_argument("--max-batch", type=int, default=64)
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    from vit22b.model.outputs import POOLED
    from vit22b.server.engine import Engine

    rows = {}
    for name in args.models:
        engine = Engine.load(name, mesh="data=2,model=1", compute_dtype="float32",
                             max_batch_images=args.max_batch)
        outputs = engine.resolve(POOLED)
        rows[name] = {}
        for bucket in engine.plan.buckets_for(engine.grid):
            stats = engine.lowered(bucket, outputs, engine.grid).compile().memory_analysis()
            rows[name][bucket] = {"temp_mb": round(stats.temp_size_in_bytes / 1e6, 1),
                                  "argument_mb": round(stats.argument_size_in_bytes / 1e6, 1)}
            log(f"{name} bucket {bucket}: {rows[name][bucket]}")
    emit({"benchmark": "activation_memory", "per_device": rows, "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
