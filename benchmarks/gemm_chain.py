"""bf16 GEMMs alone and inside a chain of MLP blocks: what another GEMM library would buy.

A GEMM timed alone on the same buffers runs from the caches; inside a forward every GEMM reads
activations another operation just wrote and writes a fresh output. This script measures both
at ViT-B/16's MLP shapes (width 768, hidden 3072), 8 images of 197 tokens:

- ``alone``: one [788, 768] x [768, 3072] GEMM, the same inputs each time: JAX (XLA:CPU's own
  kernels, f32 output) and PyTorch (oneDNN, AMX where the CPU has it; bf16 output: torch.mm
  has no f32 output for bf16 inputs on CPU);
- ``chain``: ``--layers`` blocks of x + fc2(gelu(fc1(x))), each with its own weights, as a
  forward's layers are. JAX runs it as the engine does (``--devices 2``: 2 emulated devices, 4
  images each, ``shard_map``; or 1 device), PyTorch on 2 threads. Sides, alternating, medians:
  - ``xla``: the engine's precision policy (bf16 inputs, f32 outputs, the residual in f32);
  - ``xla_bf16_outputs``: the same with bf16 GEMM outputs;
  - ``torch``: bf16 throughout (its autocast's policy);
  - ``openvino``: the same chain as an OpenVINO model (weights as constants, exact GELU), bf16
    inference precision on 2 threads, all 8 images in one call, as ``runtimes.py``'s OpenVINO
    peer runs a batch (skipped with a note when openvino is not installed): the GEMMs the
    strongest bf16 peer brings;
  - ``onednn_*``: the JAX chain with its GEMMs as oneDNN custom calls (kernels/onednn_matmul.cc,
    built here with g++ against the system's oneDNN, Debian's ``libdnnl-dev`` (2.x), or the one
    under ``ONEDNN_ROOT``: PyPI's CPU-only ``onednn-cpu-gomp`` and ``onednn-devel-cpu-gomp``
    (3.x) installed with ``pip install --prefix``; skipped with a note without them): weights
    as given (``plain``) or reordered once into oneDNN's blocked layout (``packed``), f32 or
    bf16 outputs, the GELU fused into fc1 (``gelu``).
  GFLOP/s counts the GEMMs' FLOPs over the whole chain's time.
- ``--per-gemm``: instead of the above, each of a ViT-B block's four weight GEMMs (qkv, the
  output projection, fc1, fc2) alone at one device's rows, on one thread: XLA (one emulated
  device, f32 output: the engine's policy) against OpenVINO (a one-MatMul model, weights as a
  constant, bf16 inference precision, one thread) with an f32 and with a bf16 output, and the
  outputs' relative difference from XLA's. Run it pinned to one core (``taskset -c 0``) so that
  both libraries get the same single core.

``[ONEDNN_ROOT=PREFIX] python benchmarks/gemm_chain.py [--devices 1]`` and
``taskset -c 0 python benchmarks/gemm_chain.py --per-gemm`` (results: benchmarks/NOTES.md,
"An AMX host", "oneDNN 3 from PyPI" and "The bf16 gap on Zen 4, fourth look").
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from benchlib import alternate, best_time, emit, log, machine, median

TOKENS, WIDTH, HIDDEN = 197, 768, 3072  # ViT-B/16
IMAGES = 8
KERNELS = Path(__file__).with_name("kernels") / "onednn_matmul.cc"


def build_onednn(folder: str) -> str | None:
    """The custom calls' library built into ``folder``, or None (and why, logged)."""
    import jax

    cxx = shutil.which("g++")
    root = os.environ.get("ONEDNN_ROOT", "/usr")
    if cxx is None or not os.path.isfile(f"{root}/include/oneapi/dnnl/dnnl.hpp"):
        log("oneDNN sides skipped: needs g++ and oneDNN's headers (apt install libdnnl-dev, or "
            "ONEDNN_ROOT=<prefix> of pip's onednn-cpu-gomp and onednn-devel-cpu-gomp)")
        return None
    out = os.path.join(folder, "onednn_matmul.so")
    done = subprocess.run([cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-w",
                           "-I", jax.ffi.include_dir(), "-I", f"{root}/include", str(KERNELS),
                           "-o", out, f"-L{root}/lib", f"-Wl,-rpath,{root}/lib", "-ldnnl"],
                          capture_output=True, text=True)
    if done.returncode:
        log(f"oneDNN sides skipped: the build failed:\n{done.stderr[-2000:]}")
        return None
    return out


def openvino_chain(x32, fc1, fc2):
    """The chain as one OpenVINO model in bf16 on 2 threads, or None without openvino."""
    try:
        import openvino as ov
        import openvino.opset13 as ops
    except ImportError:
        log("openvino side skipped: openvino is not installed (make bench installs it)")
        return None
    x = ops.parameter(list(x32.shape), x32.dtype, name="x")
    y = x
    for a, b in zip(fc1, fc2):
        h = ops.gelu(ops.matmul(y, ops.constant(a), False, False), approximation_mode="erf")
        y = ops.add(y, ops.matmul(h, ops.constant(b), False, False))
    compiled = ov.Core().compile_model(ov.Model([y], [x]), "CPU", {
        "INFERENCE_PRECISION_HINT": "bf16", "INFERENCE_NUM_THREADS": 2,
        "PERFORMANCE_HINT": "LATENCY"})
    request = compiled.create_infer_request()
    return lambda: request.infer({0: x32})


BLOCK_GEMMS = {"qkv": (WIDTH, 3 * WIDTH), "out": (WIDTH, WIDTH), "fc1": (WIDTH, HIDDEN),
               "fc2": (HIDDEN, WIDTH)}


def per_gemm(repeats: int) -> int:
    """Each block GEMM alone on one thread: XLA against OpenVINO's f32 and bf16 outputs."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    try:
        import openvino as ov
        import openvino.opset13 as ops
    except ImportError:
        log("--per-gemm compares with OpenVINO, which is not installed (make bench installs it)")
        return 1
    rows = IMAGES // 2 * TOKENS  # one device's rows at batch 8 (the engine's chunk of 4)
    rng = np.random.default_rng(0)
    core = ov.Core()
    dot = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
    report: dict[str, dict[str, float]] = {}
    for name, (k, n) in BLOCK_GEMMS.items():
        flops = 2.0 * rows * k * n
        x = jnp.asarray(rng.standard_normal((rows, k), np.float32), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.bfloat16)
        reference = np.asarray(dot(x, w))
        sides = {"xla": lambda x=x, w=w: dot(x, w).block_until_ready()}
        diffs = {}
        for out in ("f32", "bf16"):
            # bf16 in, the product in f32 (the plugin runs it in bf16 with f32 accumulation)
            param = ops.parameter([rows, k], ov.Type.bf16, name="x")
            y = ops.matmul(ops.convert(param, ov.Type.f32),
                           ops.constant(np.asarray(w, np.float32)), False, False)
            if out == "bf16":
                y = ops.convert(y, ov.Type.bf16)
            compiled = core.compile_model(ov.Model([y], [param]), "CPU", {
                "INFERENCE_PRECISION_HINT": "bf16", "INFERENCE_NUM_THREADS": 1,
                "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY"})
            request = compiled.create_infer_request()
            tensor = ov.Tensor(ov.Type.bf16, ov.Shape([rows, k]))
            tensor.data[...] = np.asarray(x).view(tensor.data.dtype)
            request.set_input_tensor(tensor)
            request.infer()
            got = request.get_output_tensor().data
            got = (got.view(jnp.bfloat16) if out == "bf16" else got).astype(np.float64)
            diffs[f"openvino_{out}_rel_diff"] = float(
                np.linalg.norm(got - reference) / np.linalg.norm(reference))
            sides[f"openvino_{out}"] = request.infer
        for fn in sides.values():
            fn()  # compile, warm
        times = alternate(sides, repeats)
        row = {side: flops / median(t) / 1e9 for side, t in times.items()} | diffs
        report[name] = {key: float(f"{value:.3g}") for key, value in row.items()}
        log(f"{name} [{rows}, {k}] x [{k}, {n}]: " + ", ".join(
            f"{key} {value}" for key, value in report[name].items()))
    emit({"benchmark": "gemm_chain_per_gemm", "rows": rows, "gflops": report,
          "machine": machine()})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--devices", type=int, default=2, choices=[1, 2],
                        help="emulated devices the JAX chains split the images over; each "
                        "oneDNN call gets 2 / devices threads")
    parser.add_argument("--per-gemm", action="store_true",
                        help="each block GEMM alone on one thread, XLA against OpenVINO")
    args = parser.parse_args(argv)
    devices = 1 if args.per_gemm else args.devices

    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} "
                               f"--xla_force_host_platform_device_count={devices}")
    if args.per_gemm:
        return per_gemm(args.repeats)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    bf16, f32 = jnp.bfloat16, jnp.float32
    rows = IMAGES // devices * TOKENS  # one device's GEMM rows (the engine's chunk of 4)
    rng = np.random.default_rng(0)
    x32 = rng.standard_normal((devices * rows, WIDTH), np.float32)
    fc1 = [rng.standard_normal((WIDTH, HIDDEN), np.float32) * 0.02 for _ in range(args.layers)]
    fc2 = [rng.standard_normal((HIDDEN, WIDTH), np.float32) * 0.02 for _ in range(args.layers)]
    gemm_flops = 2.0 * rows * WIDTH * HIDDEN
    chain_flops = 2 * gemm_flops * devices * args.layers
    out: dict[str, float] = {}

    # alone
    xa, wa = jnp.asarray(x32[:rows], bf16), jnp.asarray(fc1[0], bf16)
    one = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=f32))
    out["alone_xla"] = gemm_flops / best_time(lambda: one(xa, wa).block_until_ready(),
                                              args.repeats) / 1e9
    xt, wt = torch.from_numpy(x32[:rows]).bfloat16(), torch.from_numpy(fc1[0]).bfloat16()
    with torch.inference_mode():
        out["alone_torch"] = gemm_flops / best_time(lambda: torch.mm(xt, wt), args.repeats) / 1e9

    # chains
    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    x = jax.device_put(jnp.asarray(x32), NamedSharding(mesh, P("data")))
    w1 = [jnp.asarray(w, bf16) for w in fc1]
    w2 = [jnp.asarray(w, bf16) for w in fc2]

    def on_devices(body):
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P(), P()),
                                   out_specs=P("data"), check_vma=False))
        return fn

    def xla_chain(out_dtype):
        def body(x, w1, w2):
            for a, b in zip(w1, w2):
                h = jax.nn.gelu(jnp.dot(x.astype(bf16), a, preferred_element_type=out_dtype),
                                approximate=False)
                x = x + jnp.dot(h.astype(bf16), b, preferred_element_type=out_dtype).astype(f32)
            return x
        return on_devices(body)

    sides = {}
    for name, dtype in (("xla", f32), ("xla_bf16_outputs", bf16)):
        fn = xla_chain(dtype)
        sides[name] = lambda fn=fn, a=w1, b=w2: fn(x, a, b).block_until_ready()

    t1 = [torch.from_numpy(w).bfloat16() for w in fc1]
    t2 = [torch.from_numpy(w).bfloat16() for w in fc2]
    gelu = torch.nn.GELU()

    def torch_chain():
        with torch.inference_mode():
            y = torch.from_numpy(x32).bfloat16()
            for a, b in zip(t1, t2):
                y = y + torch.mm(gelu(torch.mm(y, a)), b)
        return y

    sides["torch"] = torch_chain
    openvino = openvino_chain(x32, fc1, fc2)
    if openvino is not None:
        sides["openvino"] = openvino
    folder = tempfile.TemporaryDirectory(prefix="vit22b-onednn-")
    library = build_onednn(folder.name)
    if library:
        lib = ctypes.CDLL(library)
        lib.vit22b_packed_bytes.restype = ctypes.c_int64
        for target in ("MatmulF32", "MatmulBf16", "PackWeights"):
            jax.ffi.register_ffi_target(f"vit22b_bench_{target}",
                                        jax.ffi.pycapsule(getattr(lib, target)), platform="cpu")

        def pack(w):
            size = lib.vit22b_packed_bytes(rows, *w.shape)
            return jax.jit(lambda w: jax.ffi.ffi_call(
                "vit22b_bench_PackWeights", jax.ShapeDtypeStruct((size,), jnp.uint8))(
                    w, m=np.int64(rows)))(w)

        def matmul(x, w, n, out_dtype, packed, gelu=False):
            target = "vit22b_bench_MatmulF32" if out_dtype == f32 else "vit22b_bench_MatmulBf16"
            return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape[:-1] + (n,), out_dtype))(
                x, w, n=np.int64(n), threads=np.int64(2 // devices), packed=np.int64(packed),
                packed_m=np.int64(rows), gelu=np.int64(gelu))

        def onednn_chain(packed, out_dtype, fused):
            def body(x, w1, w2):
                for a, b in zip(w1, w2):
                    if fused:
                        h = matmul(x.astype(bf16), a, HIDDEN, bf16, packed, gelu=True)
                    else:
                        h = jax.nn.gelu(matmul(x.astype(bf16), a, HIDDEN, out_dtype, packed)
                                        .astype(f32), approximate=False).astype(bf16)
                    x = x + matmul(h, b, WIDTH, f32, packed)
                return x
            return on_devices(body)

        p1, p2 = [pack(w) for w in w1], [pack(w) for w in w2]
        for name, packed, dtype, fused in (("onednn_plain", False, f32, False),
                                           ("onednn_packed", True, f32, False),
                                           ("onednn_packed_bf16_outputs", True, bf16, False),
                                           ("onednn_packed_bf16_gelu", True, bf16, True)):
            fn = onednn_chain(packed, dtype, fused)
            a, b = (p1, p2) if packed else (w1, w2)
            sides[name] = lambda fn=fn, a=a, b=b: fn(x, a, b).block_until_ready()
    for fn in sides.values():
        fn()  # compile, warm
    times = alternate(sides, args.repeats)
    for name, seconds in times.items():
        out[f"chain_{name}"] = chain_flops / median(seconds) / 1e9
    out = {k: round(v, 1) for k, v in out.items()}
    for key, value in out.items():
        log(f"{key}: {value} GFLOP/s")
    ratios = {f"ratio_{k}_to_xla": round(v / out["chain_xla"], 3)
              for k, v in out.items() if k.startswith("chain_") and k != "chain_xla"}
    emit({"benchmark": "gemm_chain", "layers": args.layers, "images": IMAGES, "devices": devices,
          "torch_threads": torch.get_num_threads(), "gflops": out, **ratios,
          "machine": machine()})
    folder.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
