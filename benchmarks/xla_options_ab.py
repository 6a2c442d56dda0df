"""XLA:CPU options A/B per compile, in one process: the engine's forward under each option set.

XLA reads ``XLA_FLAGS`` once per process, so comparing flags meant a process per side, and a
host whose speed drifts within minutes blurs such comparisons. ``Lowered.compile`` also takes
XLA's debug options per program: here the engine's forward (seeded weights, its own mesh,
bucket and chunks) is lowered once and compiled under each ``--side NAME:JSON`` (a JSON object
of options; enum options take their proto names, e.g. ``LIBRARY_FUSION_TYPE_DOT``), and the
programs' calls alternate. The first side is the reference: img/s medians, ratios to it, the
pooled features' relative difference, and each program's count of YNNPACK fusions.

    python benchmarks/xla_options_ab.py --dtype bfloat16 --side 'base:{}' \\
        --side 'ynn_dot:{"xla_cpu_experimental_ynn_fusion_type":
                         "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_DOT"}'

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

from benchlib import alternate, emit, log, machine, median


def parse_side(text: str) -> tuple[str, dict]:
    name, _, options = text.partition(":")
    return name, json.loads(options or "{}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit-b/16")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--side", action="append", required=True, dest="sides",
                        type=parse_side, help="NAME:JSON options (the first is the reference)")
    args = parser.parse_args(argv)

    from vit22b.server.cpu_devices import prepare_xla_cpu

    prepare_xla_cpu()
    import jax
    import numpy as np
    from vit22b.model.config import get_config
    from vit22b.model.outputs import POOLED
    from vit22b.model.sharding import shard_params
    from vit22b.model.vit import init_params
    from vit22b.server.engine import NORMALISED, Engine, auto_mesh

    cfg = get_config(args.model).replace(compute_dtype=args.dtype)
    mesh = auto_mesh(cfg)
    params = jax.jit(lambda r: init_params(cfg, r))(jax.random.PRNGKey(0))
    engine = Engine(cfg, shard_params(cfg, params, mesh), mesh, fingerprint="bench",
                    source="seeded", max_batch_images=max(8, args.batch))
    outputs, grid = engine.resolve(POOLED), engine.grid
    bucket = engine.bucket(args.batch)
    place = engine.placement(bucket)
    pos = engine.position(grid, place)
    lowered = engine.lowered(bucket, outputs, grid, NORMALISED)  # fed floats below
    shape = (bucket, grid[0] * cfg.patch, grid[1] * cfg.patch, cfg.channels)
    x = jax.device_put(np.random.default_rng(0).standard_normal(shape, np.float32),
                       place.batch_sharding)

    steps = np.int32(engine.steps(bucket))  # every chunk step: a full bucket
    compiled, fusions = {}, {}
    for name, options in args.sides:
        start = time.perf_counter()
        # the plan's own options under each side's (a side may override them)
        compiled[name] = lowered.compile(
            compiler_options={**engine.plan.compiler_options, **options} or None)
        fusions[name] = compiled[name].as_text().count('"__ynn_fusion"')
        log(f"{name}: compiled in {time.perf_counter() - start:.1f}s, "
            f"{fusions[name]} YNNPACK fusions")
    reference = args.sides[0][0]
    pooled = {name: np.asarray(fn(place.params, pos, x, steps)["pooled"], np.float64)
              for name, fn in compiled.items()}
    base = pooled[reference]
    rel = {name: float(f"{np.linalg.norm(p - base) / np.linalg.norm(base):.2g}")
           for name, p in pooled.items()}
    times = alternate({name: lambda fn=fn: jax.block_until_ready(fn(place.params, pos, x, steps))
                       for name, fn in compiled.items()}, args.repeats)
    rates = {name: round(bucket / median(t), 3) for name, t in times.items()}
    ratios = {name: round(rate / rates[reference], 3) for name, rate in rates.items()}
    for name in compiled:
        log(f"{args.model} {args.dtype} batch {bucket}: {name} {rates[name]} img/s "
            f"({ratios[name]}x {reference}'s, pooled rel. diff {rel[name]})")
    emit({"benchmark": "xla_options_ab", "model": args.model, "dtype": args.dtype,
          "batch": bucket, "options": dict(args.sides), "images_per_s": rates,
          "ratios": ratios, "pooled_rel_diff": rel, "ynn_fusions": fusions,
          "machine": machine()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
