"""A block's four GEMMs with the kernel stored [in, out] (as the checkpoints hold it) and [out, in].

XLA:CPU's GEMM library packs a parameter kernel on every call; from which layout it packs faster
depends on the shape. Each GEMM runs as the engine runs it on a CPU host: the rows of its chunk
(``--rows`` per device: ViT-B/16's 4 images, 788) on each of two emulated devices, the kernel
replicated, inputs in the compute dtype, f32 out. Calls alternate, medians per side; the two
layouts' outputs are compared (the same products; the summation order is the library's).

    python benchmarks/gemm_layout.py --dtype bfloat16
    python benchmarks/gemm_layout.py --dtype float32 --width 1024 --mlp 4096

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os

from benchlib import alternate, emit, log, machine, median


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, default=788, help="rows per device")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--mlp", type=int, default=3072)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)

    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=2")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    dtype, f32 = jnp.dtype(args.dtype), jnp.float32
    rng = np.random.default_rng(0)

    def put(shape, spec):
        values = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
        return jax.device_put(values, NamedSharding(mesh, spec))

    in_out = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=f32))
    out_in = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                                                      preferred_element_type=f32))
    d, m = args.width, args.mlp
    gemms = {"qkv": (d, 3 * d), "out": (d, d), "fc1": (d, m), "fc2": (m, d)}
    sides, flops, diffs = {}, {}, {}
    for name, (k, n) in gemms.items():
        x, w = put((2 * args.rows, k), P("data")), put((k, n), P())
        wt = jax.device_put(w.T, NamedSharding(mesh, P()))  # a buffer of its own, [out, in]
        sides[f"{name} [in,out]"] = lambda x=x, w=w: in_out(x, w).block_until_ready()
        sides[f"{name} [out,in]"] = lambda x=x, wt=wt: out_in(x, wt).block_until_ready()
        flops[name] = 2 * 2 * args.rows * k * n
        a, b = np.asarray(in_out(x, w)), np.asarray(out_in(x, wt))
        diffs[name] = float(np.abs(a - b).max() / np.abs(a).max())
    for fn in sides.values():  # compile and warm up
        fn(), fn()
    times = alternate(sides, args.repeats)
    rows = []
    for name, (k, n) in gemms.items():
        a, b = median(times[f"{name} [in,out]"]), median(times[f"{name} [out,in]"])
        row = {"gemm": name, "k": k, "n": n, "in_out_gflops": round(flops[name] / a / 1e9, 1),
               "out_in_gflops": round(flops[name] / b / 1e9, 1),
               "out_in_speedup": round(a / b, 3), "max_rel_diff": float(f"{diffs[name]:.2g}")}
        rows.append(row)
        log(f"{name} [{k}, {n}]: [in,out] {row['in_out_gflops']} GFLOP/s, [out,in] "
            f"{row['out_in_gflops']} ({row['out_in_speedup']}x), rel diff {row['max_rel_diff']}")
    emit({"benchmark": "gemm_layout", "dtype": args.dtype, "rows_per_device": args.rows,
          "repeats": args.repeats, "gemms": rows, "machine": machine()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
