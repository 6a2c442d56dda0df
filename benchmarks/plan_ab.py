"""The engine's forward under several execution plans, in one process, rounds alternating.

Each ``--side NAME:OPTIONS`` is one engine on the same seeded weights: ``mesh=SPEC`` (on the
first data x model devices; default: the engine's own ``auto``), ``chunk=N`` (images per shard
and step; 0: none), ``small=0`` (every bucket on every data row: no small buckets, no rows by
work), ``transposed=0|1`` (the down projections' kernels stored transposed, off or on; default:
the host's rule), ``slices=N`` (a sequential block's MLP activation and fc2 in N token slices;
default: the plan's), ``skip=0`` (every chunk step of a bucket runs, the padding's too; default:
the steps of padding alone are skipped), ``midpoints=0|1`` (the midpoint buckets 3a/2, off or
on; default: the host's rule). ``--max-batch-images`` sets the buckets' top (default: the
largest batch). Every round runs every side once per batch size
(``--calls`` forwards, after warm-up), so a drift of the machine's speed falls on all sides
alike; reported per side and batch are the medians over rounds of wall and process-CPU
microseconds per forward, and each side's ratios to the first side. Pooled features are
checked against the first side's (their largest relative difference is printed: a plan changes
where rows run, not what they compute).

    python benchmarks/plan_ab.py --model vit-22b-tiny/16 --side every-row:small=0 \
        --side plan: --batches 2 4 8 16 32                       # rows by work
    python benchmarks/plan_ab.py --dtype bfloat16 --batches 8 --side data:mesh=data=2 \
        --side model:mesh=data=1,model=2                         # ViT-B/16: the model axis
    python benchmarks/plan_ab.py --dtype bfloat16 --batches 8 --side c4:chunk=4 --side c2:chunk=2
    python benchmarks/plan_ab.py --dtype bfloat16 --batches 8 32 --side as-stored:transposed=0 \
        --side transposed:transposed=1                           # kernels stored transposed

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import math
import re
import time

from benchlib import emit, log, machine, median

INTEGER_OPTIONS = ("chunk", "small", "transposed", "slices", "skip", "midpoints")


def parse_side(text: str) -> tuple[str, dict]:
    """``NAME:key=value,...``; a value may itself hold ``=`` and ``,`` only for ``mesh``
    (``one:mesh=data=1,model=1,chunk=2``: ``mesh`` takes every ``axis=n`` after it)."""
    name, _, rest = text.partition(":")
    options: dict = {}
    key = None
    for part in filter(None, rest.split(",")):
        head, _, value = part.partition("=")
        if head in ("mesh", *INTEGER_OPTIONS):
            key = head
            options[key] = value
        elif key == "mesh":  # another axis of the mesh spec
            options["mesh"] += "," + part
        else:
            raise SystemExit(f"--side {text!r}: unknown option {head!r} (mesh=, "
                             + ", ".join(f"{o}=" for o in INTEGER_OPTIONS) + ")")
    for key in INTEGER_OPTIONS:
        if key in options:
            options[key] = int(options[key])
    return name, options


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit-b/16")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batches", type=int, nargs="+", default=[8])
    parser.add_argument("--side", action="append", required=True, dest="sides",
                        help="NAME:mesh=SPEC,chunk=N,small=0,transposed=0|1,slices=N,"
                        "skip=0,midpoints=0|1 "
                        "(repeatable; the first is the reference)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-batch-images", type=int, default=0,
                        help="the largest bucket (default: the largest --batches)")
    parser.add_argument("--calls", type=int, default=0,
                        help="forwards per side, batch and round (default: about 2 s of work)")
    args = parser.parse_args(argv)

    from vit22b.server.cpu_devices import prepare_xla_cpu

    prepare_xla_cpu()  # what `vit22b serve` does before jax starts
    import jax
    import numpy as np
    from vit22b.model import get_config
    from vit22b.model.outputs import POOLED
    from vit22b.model.sharding import make_mesh, shard_params
    from vit22b.model.vit import init_params
    from vit22b.server.engine import Engine, auto_mesh

    cfg = get_config(args.model).replace(compute_dtype=args.dtype)
    params = init_params(cfg, jax.random.key(0))
    sides = dict(parse_side(s) for s in args.sides)
    engines = {}
    for name, options in sides.items():
        if "mesh" in options:
            # the devices the spec names (an axis left out is 1)
            count = math.prod(int(n) for n in re.findall(r"=\s*(\d+)", options["mesh"]))
            mesh = make_mesh(options["mesh"], jax.devices()[:count])
        else:
            mesh = auto_mesh(cfg)
        engines[name] = Engine(cfg, shard_params(cfg, params, mesh), mesh, fingerprint="plan_ab",
                               source="seeded",
                               max_batch_images=args.max_batch_images or max(args.batches),
                               chunk_images=options.get("chunk"),
                               small_buckets=None if options.get("small", 1) else False,
                               transpose_kernels=None if "transposed" not in options
                               else bool(options["transposed"]),
                               mlp_slices=options.get("slices"),
                               skip_padding=bool(options.get("skip", 1)),
                               midpoint_buckets=None if "midpoints" not in options
                               else bool(options["midpoints"]))
        log(f"{name}: {engines[name].mesh_spec}, buckets {engines[name].buckets}")
    reference = next(iter(engines))
    rng = np.random.default_rng(0)
    rows = []
    for batch in args.batches:
        x = rng.standard_normal((batch, cfg.image_size, cfg.image_size, 3), np.float32)
        pooled = {}
        for name, engine in engines.items():  # warm-up: compile, then once more
            outputs = engine.resolve(POOLED)
            engine.forward(x, outputs)
            pooled[name] = np.asarray(engine.forward(x, outputs)["pooled"])
        start = time.perf_counter()
        engines[reference].forward(x, engines[reference].resolve(POOLED))
        calls = args.calls or max(1, round(2.0 / max(time.perf_counter() - start, 1e-4)))
        wall: dict[str, list[float]] = {n: [] for n in engines}
        cpu: dict[str, list[float]] = {n: [] for n in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                outputs = engine.resolve(POOLED)
                w, c = time.perf_counter(), time.process_time()
                for _ in range(calls):
                    engine.forward(x, outputs)
                wall[name].append((time.perf_counter() - w) / calls * 1e6)
                cpu[name].append((time.process_time() - c) / calls * 1e6)
        ref = pooled[reference]
        for name, engine in engines.items():
            row = {
                "side": name,
                "batch": batch,
                "mesh": engine.mesh_spec,
                "rows": engine.plan.rows(engine.bucket(batch)),
                "chunk_images": engine.plan.chunk_images(engine.bucket(batch)),
                "transposed": sorted(engine.plan.transposed_kernels),
                "mlp_slices": engine.plan.mlp_slices(engine.bucket(batch)),
                "wall_us": round(median(wall[name])),
                "cpu_us": round(median(cpu[name])),
                "wall_range_us": [round(min(wall[name])), round(max(wall[name]))],
                "images_per_s": round(batch / median(wall[name]) * 1e6, 2),
                "wall_ratio": round(median(wall[name]) / median(wall[reference]), 3),
                "cpu_ratio": round(median(cpu[name]) / median(cpu[reference]), 3),
                "pooled_max_rel_diff": float(
                    f"{np.abs(pooled[name] - ref).max() / np.abs(ref).max():.2g}"),
            }
            rows.append(row)
            log(f"b={batch:<3d} {name:10s} [{row['mesh']}, {row['rows']} rows, chunk "
                f"{row['chunk_images']}] wall {row['wall_us']} us ({row['wall_ratio']}x), cpu "
                f"{row['cpu_us']} us ({row['cpu_ratio']}x), {row['images_per_s']} img/s, "
                f"pooled diff {row['pooled_max_rel_diff']}")
    for engine in engines.values():
        engine.close()
    emit({"benchmark": "plan_ab", "model": args.model, "dtype": args.dtype,
          "rounds": args.rounds, "rows": rows, "machine": machine()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
