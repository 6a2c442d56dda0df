"""The engine's bf16 forward with its weight GEMMs through oneDNN: does the chain's gain carry?

``gemm_chain.py`` measures oneDNN's GEMMs on a chain of MLP blocks. This script puts the same
custom call (kernels/onednn_matmul.cc, plain weights, f32 outputs: the engine's precision
policy, bf16 inputs and f32 accumulation) under every GEMM of the model's blocks that
contracts activations with a weight (``vit.dot``: qkv, output projection, fc1, fc2), in the
engine's own forward (ViT-B/16, seeded weights, its plan's bucket and chunks), run per device
under ``shard_map`` over the data axis (one oneDNN thread per emulated device). The attention
products and everything else stay XLA's.

Sides, in one process, calls alternating (a drift of the machine falls on all): ``xla``, the
engine as it serves; ``onednn``, the same forward with the routed GEMMs; ``onednn_packed``,
with the blocks' qkv, fc1 and fc2 kernels reordered once into oneDNN's blocked layout (as an
engine would at load; XLA's libraries pack a weight on every call); ``onednn_packed_gelu``,
that and fc1's bias and exact GELU fused into its call, which writes bf16 (the values fc2
casts to bf16 anyway; ViT-B's MLP). Reported: img/s medians,
ratios to ``xla``, the pooled features' relative difference (the parity tests' measure).
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

from benchlib import alternate, emit, log, machine, median
from gemm_chain import build_onednn

# vit.dot's equations that are one matmul of the activations' last axis with the weight's first
# (the weight's other axes flattened into N); anything else stays an einsum.
MATMUL = re.compile(r"^([a-z]+)([a-z]),\2([a-z]+)->\1\3$")
PACKED = {"w_qkv", "w_fc1", "w_fc2"}
PACKED_EQUATIONS = {"btd,dhf->bthf", "btd,df->btf", "btf,fd->btd"}  # their GEMMs in vit.py


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
    from vit22b.server.engine import NORMALISED, Engine, auto_mesh

    folder = tempfile.TemporaryDirectory(prefix="vit22b-onednn-")
    library = build_onednn(folder.name)
    if library is None:
        return 1
    lib = ctypes.CDLL(library)
    lib.vit22b_packed_bytes.restype = ctypes.c_int64
    for target in ("MatmulF32", "MatmulBiasGeluBf16", "PackWeights"):
        jax.ffi.register_ffi_target(f"vit22b_bench_{target}",
                                    jax.ffi.pycapsule(getattr(lib, target)), platform="cpu")

    cfg = get_config(args.model).replace(compute_dtype="bfloat16")
    mesh = auto_mesh(cfg)
    params = jax.jit(lambda r: vit.init_params(cfg, r))(jax.random.PRNGKey(0))
    # kernels as stored ([in, out]): the routes below read them so, and the `xla` side is the
    # engine as it served when this was measured (before the plan's transposed kernels)
    engine = Engine(cfg, shard_params(cfg, params, mesh), mesh, fingerprint="bench",
                    source="seeded", max_batch_images=max(args.batch, 8), transpose_kernels=False)
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

    rows_per_call = chunk * (grid[0] * grid[1] + cfg.num_prefix_tokens)

    packed_equations: set[str] = set()  # the side being traced: whose weights come packed

    def onednn_dot(equation, a, w, compute_dtype, transposed=False):
        match = MATMUL.match(equation)
        if not match or transposed or jnp.dtype(compute_dtype) != jnp.bfloat16:
            return xla_dot(equation, a, w, compute_dtype, transposed)
        packed = equation in packed_equations
        out_axes = w.shape[1:]
        k, n = a.shape[-1], int(np.prod(out_axes))
        rows = a.reshape(-1, k).astype(jnp.bfloat16)
        weight = w.reshape(k, n).astype(jnp.bfloat16)
        y = jax.ffi.ffi_call("vit22b_bench_MatmulF32",
                             jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32))(
            rows, weight, n=np.int64(n), threads=np.int64(1), packed=np.int64(packed),
            packed_m=np.int64(rows_per_call), gelu=np.int64(0))
        routed.append(equation)
        return y.reshape(*a.shape[:-1], *out_axes)

    def pack(path, w):
        """The blocks' three large kernels reordered once into oneDNN's layout for their GEMM's
        row count, held as bf16 arrays of their own shape (the model's parameters keep their
        shapes; the layout has no padding at these sizes, checked). The output projection is
        reshaped by vit.dot_heads, so it stays plain."""
        if str(getattr(path[-1], "key", "")) not in PACKED:
            return w
        k, n = w.shape[0], int(np.prod(w.shape[1:]))
        size = lib.vit22b_packed_bytes(rows_per_call, k, n)
        if size != 2 * k * n:
            raise SystemExit(f"oneDNN's layout of a [{k}, {n}] weight has {size} bytes, not 2kn")
        return jax.jit(lambda w: jax.lax.bitcast_convert_type(jax.ffi.ffi_call(
            "vit22b_bench_PackWeights", jax.ShapeDtypeStruct((size,), jnp.uint8))(
                w.reshape(k, n).astype(jnp.bfloat16), m=np.int64(rows_per_call)
            ).reshape(k * n, 2), jnp.bfloat16).reshape(w.shape))(w)

    xla_dense, xla_activation = vit.SequentialBlock._dense, vit.activation

    def fused_dense(block, y, name, shape):
        """fc1 + bias + exact GELU in one oneDNN call with a bf16 output: the values fc2's
        ``dot`` would have cast to bf16 anyway (the precision policy kept; oneDNN's erf
        in place of vit.erf's fit)."""
        cfg = block.cfg
        if name != "fc1" or cfg.mlp != "gelu" or not cfg.gelu_exact or not cfg.mlp_bias:
            return xla_dense(block, y, name, shape)
        kernel = block.param(f"w_{name}", vit._xavier(), shape, cfg.param_dtype)
        bias = block.param(f"b_{name}", vit._zeros, shape[1:], cfg.param_dtype)
        k, n = shape
        rows = y.reshape(-1, k).astype(jnp.bfloat16)
        u = jax.ffi.ffi_call("vit22b_bench_MatmulBiasGeluBf16",
                             jax.ShapeDtypeStruct((rows.shape[0], n), jnp.bfloat16))(
            rows, kernel.astype(jnp.bfloat16), bias.astype(jnp.float32), n=np.int64(n),
            threads=np.int64(1), packed=np.int64(1), packed_m=np.int64(rows_per_call))
        routed.append("fc1+gelu")
        return u.reshape(*y.shape[:-1], n)

    def fused_activation(x, cfg):  # fc1's output is already activated (bf16)
        return x if x.dtype == jnp.bfloat16 else xla_activation(x, cfg)

    def forward(p, pos, images):  # one data shard's images
        return chunked_apply(cfg, p, images, outputs, chunk, 1, pos,
                             vit.Execution(fold_heads=engine.plan.fold_heads))

    packed_params = jax.tree_util.tree_map_with_path(pack, place.params)
    compiled = {}
    vit.dot = onednn_dot
    try:
        for name, p in (("onednn", place.params), ("onednn_packed", packed_params),
                        ("onednn_packed_gelu", packed_params)):
            routed.clear()
            packed_equations.clear()
            if name != "onednn":
                packed_equations.update(PACKED_EQUATIONS)
            fused = name == "onednn_packed_gelu"
            vit.SequentialBlock._dense = fused_dense if fused else xla_dense
            vit.activation = fused_activation if fused else xla_activation
            start = time.perf_counter()  # a jit of its own: each side is traced anew
            fn = jax.jit(jax.shard_map(forward, mesh=place.mesh, in_specs=(P(), P(), P("data")),
                                       out_specs=P("data"), check_vma=False))
            compiled[name] = fn.lower(p, pos, x).compile()
            calls = compiled[name].as_text().count("vit22b_bench_MatmulF32")
            log(f"{name} compiled in {time.perf_counter() - start:.1f}s, {len(routed)} GEMMs "
                f"routed ({sorted(set(routed))}), {calls} custom calls in the program")
    finally:
        vit.dot, vit.SequentialBlock._dense, vit.activation = xla_dot, xla_dense, xla_activation
    engine.compiled(bucket, outputs, grid, NORMALISED)  # x is normalised floats
    sides = {"xla": lambda: engine.call(bucket, outputs, place, x),
             "onednn": lambda: compiled["onednn"](place.params, pos, x),
             "onednn_packed": lambda: compiled["onednn_packed"](packed_params, pos, x),
             "onednn_packed_gelu": lambda: compiled["onednn_packed_gelu"](packed_params, pos, x)}
    pooled = {name: np.asarray(run()["pooled"], np.float64) for name, run in sides.items()}
    rel = {name: float(f"{np.linalg.norm(p - pooled['xla']) / np.linalg.norm(pooled['xla']):.2g}")
           for name, p in pooled.items() if name != "xla"}
    times = alternate({name: lambda run=run: jax.block_until_ready(run())
                       for name, run in sides.items()}, args.repeats)
    rates = {name: round(bucket / median(t), 3) for name, t in times.items()}
    ratios = {name: round(rate / rates["xla"], 3) for name, rate in rates.items() if name != "xla"}
    for name, rate in rates.items():
        log(f"{args.model} bf16 batch {bucket}: {name} {rate} img/s"
            + (f" ({ratios[name]}x xla's, pooled rel. diff {rel[name]})" if name in rel else ""))
    emit({"benchmark": "onednn_forward", "model": args.model, "batch": bucket,
          "images_per_s": rates, "ratios_to_xla": ratios, "pooled_rel_diff": rel,
          "machine": machine()})
    folder.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
