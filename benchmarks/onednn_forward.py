"""The engine's bf16 forward with its weight GEMMs through oneDNN: does the chain's gain carry?

``gemm_chain.py`` measures oneDNN's GEMMs on a chain of MLP blocks. This script puts the same
custom call (kernels/onednn_matmul.cc, plain weights, f32 outputs: the engine's precision
policy, bf16 inputs and f32 accumulation) under every GEMM of the model's blocks that
contracts activations with a weight (``vit.dot``: qkv, output projection, fc1, fc2), in the
engine's own forward (ViT-B/16, seeded weights, its plan's bucket and chunks), run per device
under ``shard_map`` over the data axis (one oneDNN thread per emulated device). The attention
products and everything else stay XLA's.

Sides, in one process, calls alternating (a drift of the machine falls on both): ``xla``, the
engine as it serves; ``onednn``, the same forward with the routed GEMMs. Reported: img/s
medians, their ratio, the pooled features' relative difference (the parity tests' measure).
Needs g++ and oneDNN (see gemm_chain.py's ``build_onednn``: Debian's ``libdnnl-dev`` or
``ONEDNN_ROOT``).

    ONEDNN_ROOT=PREFIX python benchmarks/onednn_forward.py [--batch 8] [--repeats 8]
"""

from __future__ import annotations

import argparse
import ctypes
import re
import tempfile
import time

from benchlib import emit, log, machine, median
from gemm_chain import build_onednn

# vit.dot's equations that are one matmul of the activations' last axis with the weight's first
# (the weight's other axes flattened into N); anything else stays an einsum.
MATMUL = re.compile(r"^([a-z]+)([a-z]),\2([a-z]+)->\1\3$")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit-b/16")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args(argv)

    from vit22b.server.cpu_devices import prepare_xla_cpu

    prepare_xla_cpu()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P
    from vit22b.model import vit
    from vit22b.model.config import get_config
    from vit22b.model.forward import chunked_apply
    from vit22b.model.outputs import POOLED
    from vit22b.model.sharding import shard_params
    from vit22b.server.engine import Engine, auto_mesh

    folder = tempfile.TemporaryDirectory(prefix="vit22b-onednn-")
    library = build_onednn(folder.name)
    if library is None:
        return 1
    lib = ctypes.CDLL(library)
    jax.ffi.register_ffi_target("vit22b_bench_MatmulF32", jax.ffi.pycapsule(lib.MatmulF32),
                                platform="cpu")

    cfg = get_config(args.model).replace(compute_dtype="bfloat16")
    mesh = auto_mesh(cfg)
    params = jax.jit(lambda r: vit.init_params(cfg, r))(jax.random.PRNGKey(0))
    engine = Engine(cfg, shard_params(cfg, params, mesh), mesh, fingerprint="bench",
                    source="seeded", max_batch_images=max(args.batch, 8))
    outputs, grid = engine.resolve(POOLED), engine.grid
    bucket = engine.bucket(args.batch)
    place = engine.placement(bucket)
    if place.mesh.shape.get("model", 1) != 1:
        raise SystemExit("the route runs per data shard: a mesh with a model axis is not measured")
    pos = engine.position(grid, place)
    chunk = engine.plan.chunk_images(bucket, grid)
    shape = (bucket, grid[0] * cfg.patch, grid[1] * cfg.patch, cfg.channels)
    x = jax.device_put(np.random.default_rng(0).standard_normal(shape, np.float32),
                       place.batch_sharding)

    xla_dot = vit.dot
    routed = []

    def onednn_dot(equation, a, w, compute_dtype):
        match = MATMUL.match(equation)
        if not match or jnp.dtype(compute_dtype) != jnp.bfloat16:
            return xla_dot(equation, a, w, compute_dtype)
        k, n = a.shape[-1], int(np.prod(w.shape[1:]))
        rows = a.reshape(-1, k).astype(jnp.bfloat16)
        y = jax.ffi.ffi_call("vit22b_bench_MatmulF32",
                             jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32))(
            rows, w.reshape(k, n).astype(jnp.bfloat16), n=np.int64(n), threads=np.int64(1),
            packed=np.int64(0), packed_m=np.int64(0), gelu=np.int64(0))
        routed.append(equation)
        return y.reshape(*a.shape[:-1], *w.shape[1:])

    def forward(p, pos, images):  # one data shard's images
        return chunked_apply(cfg, p, images, outputs, chunk, 1, pos, engine.plan.fold_heads)

    vit.dot = onednn_dot
    try:
        fn = jax.jit(jax.shard_map(forward, mesh=place.mesh, in_specs=(P(), P(), P("data")),
                                   out_specs=P("data"), check_vma=False))
        start = time.perf_counter()
        onednn = fn.lower(place.params, pos, x).compile()
        calls = onednn.as_text().count("vit22b_bench_MatmulF32")
        log(f"onednn side compiled in {time.perf_counter() - start:.1f}s, {len(routed)} GEMMs "
            f"routed ({sorted(set(routed))}), {calls} custom calls in the program")
    finally:
        vit.dot = xla_dot
    base = engine.compiled(bucket, outputs, grid)
    sides = {"xla": lambda: base(place.params, pos, x),
             "onednn": lambda: onednn(place.params, pos, x)}
    pooled = {name: np.asarray(run()["pooled"], np.float64) for name, run in sides.items()}
    rel = float(np.linalg.norm(pooled["onednn"] - pooled["xla"]) / np.linalg.norm(pooled["xla"]))
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, run in sides.items():
            start = time.perf_counter()
            jax.block_until_ready(run())
            times[name].append(time.perf_counter() - start)
    rates = {name: round(bucket / median(t), 3) for name, t in times.items()}
    ratio = round(rates["onednn"] / rates["xla"], 3)
    log(f"{args.model} bf16 batch {bucket}: xla {rates['xla']} img/s, onednn {rates['onednn']} "
        f"img/s ({ratio}x), pooled rel. diff {rel:.2g}")
    emit({"benchmark": "onednn_forward", "model": args.model, "batch": bucket,
          "images_per_s": rates, "ratio_onednn_to_xla": ratio,
          "pooled_rel_diff": float(f"{rel:.2g}"), "routed_gemms": len(routed),
          "machine": machine()})
    folder.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
