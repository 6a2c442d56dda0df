"""Shared by the benchmarks: timing, medians, the machine, a matmul peak, the closing JSON line.

No jax or torch at import time: ``matmul_peaks`` imports them when called, so a script can set
XLA_FLAGS first.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median(values: list[float]) -> float:
    return statistics.median(values)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(min(rank, len(ordered))) - 1]


def load_average() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return -1.0


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    """The matmul-relevant ISA extensions of this CPU (AVX2 and FMA, AVX-512, its BF16, AMX,
    VNNI): a CPU with none of AVX-512's is named by its AVX2 alone."""
    wanted = ("amx", "avx2", "avx512_bf16", "avx512f", "avx_vnni", "bf16", "fma")  # bf16: Arm
    return sorted(f for f in _all_flags() if f.startswith(wanted))


def cpu_clock_ghz() -> float:
    """The clock /proc/cpuinfo reports (the highest over cores), in GHz; 0.0 if it says none.

    Under a hypervisor this is the nominal (TSC) clock: cores may boost above it."""
    mhz = []
    try:
        with open("/proc/cpuinfo") as f:
            mhz = [float(line.split(":", 1)[1]) for line in f if line.startswith("cpu MHz")]
    except (OSError, ValueError):
        pass
    return round(max(mhz) / 1e3, 3) if mhz else 0.0


def cpu_family() -> tuple[str, int]:
    """(vendor id, CPU family) from /proc/cpuinfo."""
    vendor, family = "", 0
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key.strip() == "cpu family" and not family:
                    family = int(value)
    except (OSError, ValueError):
        pass
    return vendor, family


AMX_BF16_FLOP_PER_CYCLE = 1024  # per core: one TDPBF16PS tile product per 16 cycles, 16x32x16x2


def theoretical_peak(cores: int | None = None, clock_ghz: float | None = None) -> dict:
    """The CPU's theoretical GEMM peak: cores x FLOP/cycle x clock, with the assumptions stated.

    FLOP per cycle and core = FMA units x f32 lanes x 2 (an FMA is two FLOPs). Assumed: 2 FMA
    units per core (every AVX-512 server core of Intel since Skylake-SP and AMD's Zen 4 / 5);
    lanes from the ISA flags: 16 with avx512f, 8 with AVX2 + FMA; AMD family 25 (Zen 4) runs
    512-bit operations on 256-bit units (8 lanes per unit); bf16 with avx512_bf16 twice the f32
    rate (VDPBF16PS: pairs of products per f32 lane); with AMX (``amx_bf16``) bf16 at the tile
    unit's 1,024 FLOP per cycle and core (Intel's figure for Sapphire Rapids and later), which
    only a GEMM library with AMX kernels can approach.
    """
    flags = _all_flags()
    vendor, family = cpu_family()
    cores = cores or os.cpu_count() or 1
    clock = cpu_clock_ghz() if clock_ghz is None else clock_ghz
    lanes = 16 if "avx512f" in flags else 8 if "fma" in flags else 4
    if lanes == 16 and vendor == "AuthenticAMD" and family == 25:
        lanes = 8  # Zen 4: 512-bit instructions double-pumped on 256-bit units
    units = 2
    f32 = cores * units * lanes * 2 * clock
    if "amx_bf16" in flags:
        bf16 = cores * AMX_BF16_FLOP_PER_CYCLE * clock
        bf16_rule = (f"{cores} cores x {AMX_BF16_FLOP_PER_CYCLE} FLOP per cycle (AMX tiles) x "
                     f"{clock} GHz")
    elif "avx512_bf16" in flags:
        bf16, bf16_rule = 2 * f32, "2x f32 (avx512_bf16 pairs)"
    else:
        bf16, bf16_rule = f32, "as f32 (no avx512_bf16)"
    return {
        "cores": cores, "clock_ghz": clock, "fma_units": units, "f32_lanes": lanes,
        "vendor": vendor, "family": family,
        "peak_float32": round(f32, 1), "peak_bfloat16": round(bf16, 1),
        "assumption": f"{cores} cores x {units} FMA units x {lanes} f32 lanes x 2 FLOP x "
        f"{clock} GHz (clock as /proc/cpuinfo reports it); bf16 {bf16_rule}",
    }


def _all_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "torch", "transformers", "grpc"):
        module = sys.modules.get(name)
        if module is not None:
            out[name] = getattr(module, "__version__", "?")
    return out


def machine() -> dict:
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "isa": cpu_flags(),
        "load_avg_1m": load_average(),
        **versions(),
    }


def best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up (compile)
    return min(timed(fn) for _ in range(repeats))


def alternate(sides: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds per call of every side, each repeat running every side once, in turn."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            times[name].append(timed(fn))
    return times


# n x n x n cubes, and ViT-B/16's MLP GEMMs at the engine's CPU chunk (4 images: 788 rows) and
# at 8 images (1576 rows): a CPU's best is at shapes that fit its caches.
CPU_GEMMS = ((1024,) * 3, (2048,) * 3, (4096,) * 3, (788, 768, 3072), (1576, 3072, 768))


def matmul_peaks(
    shapes: tuple[tuple[int, int, int], ...] = CPU_GEMMS,
    repeats: int = 5,
    torch_device: str | None = "cpu",
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    budget_s: float = 30.0,
) -> dict[str, float]:
    """Best GFLOP/s of (m, k, n) GEMMs per dtype, from JAX (XLA, default device), PyTorch
    (oneDNN / MKL on CPU, cuBLAS on ``torch_device="cuda"``; None: JAX only) and, on a CPU,
    OpenVINO when it is installed (a one-MatMul model, the weight a constant, on every core: its
    GEMMs were 2-4% faster than XLA's per core at f32 outputs, more at bf16 ones; NOTES.md, "The
    bf16 gap on Zen 4, fourth look").

    bf16: bf16 inputs with f32 accumulation, as the models use (torch's and OpenVINO's write
    bf16, XLA's f32: each library as it runs fastest). ``<lib>_<dtype>`` is a library's
    best over the shapes; ``peak_<dtype>`` the best of all: the peak an MFU is reported against,
    measured in the same run. OpenVINO's bf16 is left out where its CPU plugin has no BF16
    capability (its bf16 hint runs f32 there). A library's later shapes are skipped (and
    logged) where its rate so far predicts more than ``budget_s`` for one: torch's bf16 GEMM on
    a CPU without bf16 instructions runs at about 1 GFLOP/s, 20 minutes for the 4096 cube.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    out: dict[str, float] = {}
    rng = np.random.default_rng(0)
    gemm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    if torch_device is not None:
        import torch

        sync = torch.cuda.synchronize if torch_device.startswith("cuda") else (lambda: None)

    def keep(key: str, seconds: float, flops: float) -> None:
        out[key] = max(out.get(key, 0.0), flops / seconds / 1e9)

    def affordable(key: str, flops: float) -> bool:
        if key not in out or flops / (out[key] * 1e9) * (repeats + 1) <= budget_s:
            return True
        log(f"GEMM peak: {key} skips {m}x{k}x{n}: at its {out[key]:.1f} GFLOP/s so far it "
            f"would take over {budget_s:.0f} s")
        return False

    openvino = _openvino_gemm() if torch_device in (None, "cpu") else None
    skipped = set()
    if openvino is not None and "bfloat16" in dtypes and (why := openvino_bf16_shortfall()):
        log(f"GEMM peak: openvino_bfloat16 left out: {why}")  # an f32 GEMM is no bf16 peak
        skipped.add("openvino_bfloat16")
    for m, k, n in shapes:
        a32 = rng.standard_normal((m, k), np.float32)
        b32 = rng.standard_normal((k, n), np.float32)
        flops = 2.0 * m * k * n
        for dtype in dtypes:
            if openvino is not None and f"openvino_{dtype}" not in skipped and affordable(
                    f"openvino_{dtype}", flops):
                keep(f"openvino_{dtype}", best_time(openvino(a32, b32, dtype), repeats), flops)
            a, b = jnp.asarray(a32, dtype), jnp.asarray(b32, dtype)
            if affordable(f"jax_{dtype}", flops):
                keep(f"jax_{dtype}", best_time(lambda x=a, y=b: gemm(x, y).block_until_ready(),
                                               repeats), flops)
            if torch_device is None or not affordable(f"torch_{dtype}", flops):
                continue
            a = torch.from_numpy(a32).to(torch_device, getattr(torch, dtype))
            b = torch.from_numpy(b32).to(torch_device, getattr(torch, dtype))
            with torch.inference_mode():
                seconds = best_time(lambda x=a, y=b: (torch.mm(x, y), sync()), repeats)
            keep(f"torch_{dtype}", seconds, flops)
    for dtype in dtypes:
        out[f"peak_{dtype}"] = max(v for key, v in out.items() if key.endswith(dtype))
    return {key: round(v, 1) for key, v in out.items()}


def openvino_bf16_shortfall() -> str | None:
    """Why OpenVINO's CPU plugin would not compute in bf16 here, or None."""
    import openvino as ov

    capabilities = ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    if "BF16" in capabilities:
        return None
    return (f"OpenVINO's CPU plugin has no BF16 capability here ({', '.join(capabilities)}): "
            "its bf16 hint runs f32")


def _openvino_gemm():
    """``(a, b, dtype) -> a call of a * b`` in OpenVINO on every core, or None without it."""
    import numpy as np

    try:
        import openvino as ov
        import openvino.opset13 as ops
    except ImportError:
        log("GEMM peak: openvino not installed, its GEMM left out (make bench installs it)")
        return None
    core = ov.Core()

    def call(a, b, dtype: str):
        bf16 = dtype == "bfloat16"
        x = ops.parameter(list(a.shape), ov.Type.bf16 if bf16 else ov.Type.f32, name="x")
        y = ops.matmul(ops.convert(x, ov.Type.f32) if bf16 else x, ops.constant(b), False, False)
        if bf16:
            y = ops.convert(y, ov.Type.bf16)
        compiled = core.compile_model(ov.Model([y], [x]), "CPU", {
            "INFERENCE_PRECISION_HINT": "bf16" if bf16 else "f32",
            "PERFORMANCE_HINT": "LATENCY"})
        request = compiled.create_infer_request()
        tensor = ov.Tensor(ov.Type.bf16 if bf16 else ov.Type.f32, ov.Shape(list(a.shape)))
        if bf16:  # the bf16 bits of a (truncated; the values do not matter to the time)
            tensor.data[...] = (a.view(np.uint32) >> 16).astype(np.uint16).view(
                tensor.data.dtype)
        else:
            tensor.data[...] = a
        request.set_input_tensor(tensor)
        return request.infer

    return call


def emit(result: dict) -> None:
    """The closing JSON line (ratios under keys containing 'ratio')."""
    print(json.dumps(result), flush=True)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def serve_process(flags: list[str]) -> tuple[subprocess.Popen, str]:
    """`vit22b serve --port 0 --metrics-port -1 --log-level WARNING FLAGS...` in its own process,
    once it reports SERVING: (the process, its address). Its later output is drained (a full
    pipe would block the server) and logged."""
    command = [sys.executable, "-m", "vit22b.clients.cli", "serve", "--port", "0",
               "--metrics-port", "-1", "--log-level", "WARNING", *flags]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        match = re.search(r"SERVING .* on (\S+),", line)
        if match:
            threading.Thread(target=lambda: [log(f"server: {x.rstrip()}") for x in proc.stdout],
                             daemon=True).start()
            return proc, match[1]
    raise RuntimeError("the server did not report SERVING")


def plan_extras(row: dict) -> str:
    """The plan's bf16 AMX levers of a result row, as text ("" where none applies)."""
    text = ""
    if row.get("engine_transposed"):
        text += f", {'+'.join(row['engine_transposed'])} stored [out, in]"
    if row.get("engine_mlp_slices", 1) > 1:
        text += f", MLP in {row['engine_mlp_slices']} slices"
    return text
