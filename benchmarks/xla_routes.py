"""The engine's forward through XLA:CPU's other GEMM routes: are any of them faster here?

Sides, each in its own process (XLA reads its flags once, at start), rounds alternating:

- ``ynnpack``: the engine as it serves, XLA:CPU's default library alone (YNNPACK;
  ``--xla_cpu_use_onednn=false``; the weights are the compiled forward's arguments, packed into
  the kernels' layout on every call);
- ``constants``: the same forward with the weights closed over, so XLA compiles them in as
  constants: YNNPACK then packs them once, when it builds its runtime (PyTorch's "freezing"
  idea), at the cost of a copy of the weights inside every compiled bucket;
- ``onednn``: XLA's own oneDNN fusions for dots (``--xla_cpu_use_onednn=true
  --xla_cpu_experimental_onednn_fusion_type=dot``): they take the dots YNNPACK leaves (this
  jaxlib: float32 x float32, and any dot with a bf16 output), YNNPACK keeps the rest. Measured,
  not adopted: this jaxlib's oneDNN fusion killed a process with SIGILL on an optax training
  step's fusion (benchmarks/NOTES.md);
- ``onednn_only``: the same with YNNPACK's fusions off (``--xla_cpu_experimental_ynn_fusion_
  type=``), so every dot reaches oneDNN's fusion (bf16 dots as float32: this jaxlib's oneDNN
  fusion takes float32 only).
- ``--flags NAME=FLAGS`` (repeatable): any other set of XLA:CPU flags as a side of its own, the
  engine as it serves otherwise (``--sides`` picks which of the sides above run; ``ynnpack``,
  the reference, always does).
Each side reports how many of the compiled program's fusions are oneDNN's and YNNPACK's.

Then one optax training step of the video probe's attention pool (float32, ``probes/video.py``)
runs in a process of its own under each flag set, and its exit status is reported: under the
oneDNN flags this jaxlib prints "partition compile failed" and dies of SIGILL (status -4).

Each side: ViT-B/16 with seeded weights, the engine's own mesh, bucket and chunks, ``--repeats``
timed forwards of one batch per round after a warm-up; img/s medians over all rounds, the
pooled features' relative error against ``ynnpack``'s (the parity tests' measure).
``python benchmarks/xla_routes.py [--dtype bfloat16] [--batch 8] [--rounds 2]`` (results:
benchmarks/NOTES.md); a screen of other flags, the training step skipped::

    python benchmarks/xla_routes.py --sides --no-training \
        --flags sched=--xla_cpu_enable_concurrency_optimized_scheduler=true
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import emit, log, machine, median

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from peers import rel_err  # noqa: E402  (the parity tests' measure of agreement)

ONEDNN_FLAGS = "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_fusion_type=dot"
YNNPACK_ONLY = "--xla_cpu_use_onednn=false"  # explicit, over any XLA_FLAGS of the caller
FLAGS = {"ynnpack": YNNPACK_ONLY, "constants": YNNPACK_ONLY, "onednn": ONEDNN_FLAGS,
         "onednn_only": f"{ONEDNN_FLAGS} --xla_cpu_experimental_ynn_fusion_type="}
SIDES = ("ynnpack", "constants", "onednn", "onednn_only")


def side(name: str, dtype: str, batch: int, repeats: int, out: str) -> dict:
    """One side in this process (XLA_FLAGS already set by the parent)."""
    from vit22b.server.cpu_devices import prepare_xla_cpu

    prepare_xla_cpu()
    import jax
    import numpy as np
    from vit22b.model.config import get_config
    from vit22b.model.forward import chunked_apply
    from vit22b.model.outputs import POOLED
    from vit22b.model.sharding import shard_params
    from vit22b.model.vit import init_params
    from vit22b.server.engine import NORMALISED, Engine, auto_mesh

    cfg = get_config("vit-b/16").replace(compute_dtype=dtype)
    mesh = auto_mesh(cfg)
    params = jax.jit(lambda r: init_params(cfg, r))(jax.random.PRNGKey(0))
    engine = Engine(cfg, shard_params(cfg, params, mesh), mesh, fingerprint="bench",
                    source="seeded", max_batch_images=max(batch, 8))
    outputs, grid = engine.resolve(POOLED), engine.grid
    bucket = engine.bucket(batch)
    place = engine.placement(bucket)
    pos = engine.position(grid, place)
    shape = (bucket, grid[0] * cfg.patch, grid[1] * cfg.patch, cfg.channels)
    start = time.perf_counter()
    if name == "constants":
        chunk, shards = engine.plan.chunk_images(bucket, grid), place.mesh.shape["data"]
        weights = place.params
        execution = engine.execution(bucket, grid)
        fn = jax.jit(lambda pos, images: chunked_apply(cfg, weights, images, outputs, chunk,
                                                       shards, pos, execution),
                     in_shardings=(None if pos is None else place.param_shardings["pos_embedding"],
                                   place.batch_sharding))
        compiled = fn.lower(pos, jax.ShapeDtypeStruct(shape, np.float32,
                                                      sharding=place.batch_sharding)).compile(
            compiler_options=engine.plan.compiler_options or None)

        def run(x):
            return compiled(pos, x)
    else:
        compiled = engine.compiled(bucket, outputs, grid, NORMALISED)  # x: floats

        def run(x):
            return engine.call(bucket, outputs, place, x)
    compile_s = time.perf_counter() - start
    hlo = compiled.as_text()
    x = jax.device_put(np.random.default_rng(0).standard_normal(shape, np.float32),
                       place.batch_sharding)
    pooled = np.asarray(run(x)["pooled"])
    np.save(out, pooled)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(x))
        times.append(time.perf_counter() - start)
    return {"images_per_s": [round(bucket / t, 3) for t in times], "compile_s": round(compile_s, 1),
            "onednn_fusions": hlo.count('"__onednn_fusion"'),
            "ynn_fusions": hlo.count('"__ynn_fusion"'), "bucket": bucket}


def training_step() -> dict:
    """One jitted optax step of ``AttentionPool`` (float32 dots forward and backward)."""
    import jax
    import numpy as np
    import optax
    from vit22b.probes.video import AttentionPool

    x = np.random.default_rng(0).standard_normal((90, 8, 32)).astype(np.float32)
    y = np.arange(90) % 3
    module = AttentionPool(3, 8, 32, 4)
    params = jax.jit(module.init)(jax.random.PRNGKey(0), x[:1])
    optimizer = optax.adamw(1e-2)

    @jax.jit
    def step(params, state):
        def loss(p):
            return optax.softmax_cross_entropy_with_integer_labels(module.apply(p, x), y).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    return {"loss": float(step(params, optimizer.init(params))[2])}


def run_side(name: str, flags: str, args, out: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
    return subprocess.run([sys.executable, __file__, "--side", name, "--dtype", args.dtype,
                           "--batch", str(args.batch), "--repeats", str(args.repeats),
                           "--out", out], env=env, capture_output=True, text=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sides", nargs="*", choices=SIDES, default=list(SIDES),
                        help="which of the named routes run (ynnpack always does)")
    parser.add_argument("--flags", action="append", default=[], metavar="NAME=FLAGS",
                        help="another side: the engine under these XLA flags (repeatable)")
    parser.add_argument("--no-training", action="store_true",
                        help="skip the training step under the oneDNN flags")
    parser.add_argument("--side", help=argparse.SUPPRESS)  # a child process
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side == "training":
        print(json.dumps(training_step()))
        return 0
    if args.side:
        print(json.dumps(side(args.side, args.dtype, args.batch, args.repeats, args.out)))
        return 0

    import numpy as np

    flags = {"ynnpack": FLAGS["ynnpack"], **{n: FLAGS[n] for n in args.sides}}
    for item in args.flags:
        name, sep, value = item.partition("=")
        if not sep or not name or name in flags:
            parser.error(f"--flags {item!r}: NAME=FLAGS with a new name")
        flags[name] = value
    folder = tempfile.TemporaryDirectory(prefix="vit22b-routes-")
    results: dict[str, list[dict]] = {name: [] for name in flags}
    for _ in range(args.rounds):
        for name, side_flags in flags.items():
            out = os.path.join(folder.name, f"{name}.npy")
            done = run_side(name, side_flags, args, out)
            if done.returncode:
                raise SystemExit(f"side {name} failed:\n{done.stderr[-3000:]}")
            results[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            log(f"{name}: {results[name][-1]}")
    reference = np.load(os.path.join(folder.name, "ynnpack.npy"))
    summary = {}
    for name, runs in results.items():
        pooled = np.load(os.path.join(folder.name, f"{name}.npy"))
        rate = median([v for run in runs for v in run["images_per_s"]])
        summary[name] = {
            "images_per_s": round(rate, 3),
            "compile_s": [run["compile_s"] for run in runs],
            "onednn_fusions": runs[-1]["onednn_fusions"],
            "ynn_fusions": runs[-1]["ynn_fusions"],
            "pooled_rel_err_vs_ynnpack": float(f"{rel_err(pooled, reference):.2g}"),
        }
        log(f"{name:10s} {rate:7.3f} img/s  {summary[name]}")
    training = {}
    for name in () if args.no_training else ("ynnpack", "onednn"):
        done = run_side("training", FLAGS[name], args)
        said = [line for line in done.stderr.splitlines() if "partition compile failed" in line]
        training[name] = {"exit_status": done.returncode, "partition_compile_failed": bool(said)}
        log(f"training step under the {name} flags: exit status {done.returncode}"
            + (" (partition compile failed)" if said else ""))
    base = summary["ynnpack"]["images_per_s"]
    emit({"benchmark": "xla_routes", "model": "vit-b/16", "dtype": args.dtype,
          "batch": args.batch, "bucket": results["ynnpack"][-1]["bucket"], "sides": summary,
          "training_step": training,
          "flags": flags,
          **{f"ratio_{n}_to_ynnpack": round(s["images_per_s"] / base, 3)
             for n, s in summary.items() if n != "ynnpack"},
          "machine": machine()})
    folder.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
