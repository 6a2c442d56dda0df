"""Shared by the benchmarks: timing, medians, the machine, a matmul peak, the closing JSON line.

No jax or torch at import time: ``matmul_peaks`` imports them when called, so a script can set
XLA_FLAGS first.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
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
    """The matmul-relevant ISA extensions of this CPU (AVX-512 BF16, AMX, VNNI)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split(":", 1)[1].split()
                    wanted = ("amx", "avx512_bf16", "avx512f", "avx_vnni")
                    return sorted(f for f in flags if f.startswith(wanted))
    except OSError:
        pass
    return []


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
) -> dict[str, float]:
    """Best GFLOP/s of (m, k, n) GEMMs per dtype, from JAX (XLA, default device) and PyTorch
    (oneDNN / MKL on CPU, cuBLAS on ``torch_device="cuda"``; None: JAX only).

    bf16: bf16 inputs with f32 accumulation, as the models use. ``<lib>_<dtype>`` is a library's
    best over the shapes; ``peak_<dtype>`` the best of all: the peak an MFU is reported against,
    measured in the same run.
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

    for m, k, n in shapes:
        a32 = rng.standard_normal((m, k), np.float32)
        b32 = rng.standard_normal((k, n), np.float32)
        flops = 2.0 * m * k * n
        for dtype in dtypes:
            a, b = jnp.asarray(a32, dtype), jnp.asarray(b32, dtype)
            keep(f"jax_{dtype}", best_time(lambda x=a, y=b: gemm(x, y).block_until_ready(),
                                           repeats), flops)
            if torch_device is None:
                continue
            a = torch.from_numpy(a32).to(torch_device, getattr(torch, dtype))
            b = torch.from_numpy(b32).to(torch_device, getattr(torch, dtype))
            with torch.inference_mode():
                seconds = best_time(lambda x=a, y=b: (torch.mm(x, y), sync()), repeats)
            keep(f"torch_{dtype}", seconds, flops)
    for dtype in dtypes:
        out[f"peak_{dtype}"] = max(v for key, v in out.items() if key.endswith(dtype))
    return {key: round(v, 1) for key, v in out.items()}


def emit(result: dict) -> None:
    """The closing JSON line (ratios under keys containing 'ratio')."""
    print(json.dumps(result), flush=True)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
