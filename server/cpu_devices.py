"""XLA:CPU settings fixed when jax starts (emulated devices, vector width): set before importing it.

Devices: XLA:CPU runs one program on a host's cores; in float32 two programs on two emulated
devices (the batch split over the mesh's data axis) keep both cores of a 2-core host busy where
one does not (server/plan.py). The server's command line asks for them before anything imports
jax. A count the user set in ``XLA_FLAGS`` wins; on a GPU or TPU host the flag changes only the
(unused) CPU platform.

Vector width: XLA:CPU emits its own fused loops (GELU, norms, softmax pieces) with 256-bit
vectors by default; on a CPU with AVX-512 the 512-bit ones halve the exact GELU's time and raise
the float32 forward by about 3% (benchmarks/NOTES.md). A width the user set wins.

oneDNN for float32 dots: XLA:CPU's default GEMM library (YNNPACK) takes every dot it supports;
with ``--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_fusion_type=dot`` the dots it
leaves go to XLA's own oneDNN fusions. In this jaxlib YNNPACK keeps the bf16-input dots (a
bf16 forward's GEMMs are unchanged; only its float32 dots, such as a MAP head's one-query
attention, move) and oneDNN takes the float32 ones, at strict float32 (no reduced-precision
math mode). On an Intel Xeon that made the ViT-B/16 float32 forward 7-11% faster
(``benchmarks/xla_routes.py``, benchmarks/NOTES.md); it is unmeasured on other vendors' CPUs,
so it is set on Intel CPUs only. A user's own ``--xla_cpu_use_onednn`` (``=false`` turns it
off) wins.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

from .plan import CPU_DEVICES

FLAG = "--xla_force_host_platform_device_count"
VECTOR_FLAG = "--xla_cpu_prefer_vector_width"
ONEDNN_FLAG = "--xla_cpu_use_onednn"
ONEDNN_DOTS = f"{ONEDNN_FLAG}=true --xla_cpu_experimental_onednn_fusion_type=dot"


def prepare_xla_cpu(environ: MutableMapping[str, str] = os.environ) -> int | None:
    """The settings below, before jax starts; returns the device count set (or None)."""
    codegen_flags(environ)
    return emulate_cpu_devices(environ)


def codegen_flags(environ: MutableMapping[str, str] = os.environ) -> None:
    """The settings that decide the code XLA:CPU generates (not the device count): every
    process that must compute what a server computes, bit for bit, sets them (tests, local jobs).
    """
    prefer_wide_vectors(environ)
    onednn_float32_dots(environ)


def onednn_float32_dots(environ: MutableMapping[str, str] = os.environ) -> bool:
    """float32 dots through XLA's oneDNN fusions on an Intel CPU, unless the user chose.

    Returns whether the flags were set (False: another vendor's CPU, the user's choice, or jax
    already started).
    """
    flags = environ.get("XLA_FLAGS", "")
    if ONEDNN_FLAG in flags or "jax" in sys.modules or cpu_vendor() != "GenuineIntel":
        return False
    environ["XLA_FLAGS"] = f"{flags} {ONEDNN_DOTS}".strip()
    return True


def prefer_wide_vectors(environ: MutableMapping[str, str] = os.environ) -> int | None:
    """512-bit vectors in XLA:CPU's own loops where the CPU has AVX-512, unless the user chose.

    Returns the width set, or None (no AVX-512, the user's choice, or jax already started).
    """
    flags = environ.get("XLA_FLAGS", "")
    if VECTOR_FLAG in flags or "jax" in sys.modules or not _has_avx512():
        return None
    environ["XLA_FLAGS"] = f"{flags} {VECTOR_FLAG}=512".strip()
    return 512


def _has_avx512() -> bool:
    return "avx512f" in (cpu_flags() or ())


def cpu_flags() -> frozenset[str] | None:
    """The first core's ISA flags (x86 ``flags``, Arm ``Features``), or None where
    /proc/cpuinfo cannot tell (not Linux)."""
    value = _cpuinfo(("flags", "Features"))
    return None if value is None else frozenset(value.split())


def cpu_vendor() -> str | None:
    """The x86 vendor (``GenuineIntel``, ``AuthenticAMD``), or None (Arm, not Linux)."""
    return _cpuinfo(("vendor_id",))


def _cpuinfo(keys: tuple[str, ...]) -> str | None:
    """The first core's value of the first of ``keys`` in /proc/cpuinfo, or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in keys:
                    return value.strip()
    except OSError:
        pass
    return None


def emulate_cpu_devices(environ: MutableMapping[str, str] = os.environ) -> int | None:
    """Ask XLA for ``min(cores, CPU_DEVICES)`` CPU devices unless the user chose a count.

    Returns the count set, or None when the user's choice stands or jax is already imported
    (too late: the count is fixed at jax's start).
    """
    flags = environ.get("XLA_FLAGS", "")
    if FLAG in flags or "jax" in sys.modules:
        return None
    count = max(1, min(os.cpu_count() or 1, CPU_DEVICES))
    environ["XLA_FLAGS"] = f"{flags} {FLAG}={count}".strip()
    return count
