"""XLA:CPU settings fixed when jax starts (emulated devices, vector width): set before importing it.

Devices: XLA:CPU runs one program on a host's cores; in float32 two programs on two emulated
devices (the batch split over the mesh's data axis) keep both cores of a 2-core host busy where
one does not (server/plan.py). The server's command line asks for them before anything imports
jax. A count the user set in ``XLA_FLAGS`` wins; on a GPU or TPU host the flag changes only the
(unused) CPU platform.

Vector width: XLA:CPU emits its own fused loops (GELU, norms, softmax pieces) with 256-bit
vectors by default; on a CPU with AVX-512 the 512-bit ones halve the exact GELU's time and raise
the float32 forward by about 3% (benchmarks/NOTES.md). A width the user set wins.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

from .plan import CPU_DEVICES

FLAG = "--xla_force_host_platform_device_count"
VECTOR_FLAG = "--xla_cpu_prefer_vector_width"


def prepare_xla_cpu(environ: MutableMapping[str, str] = os.environ) -> int | None:
    """Both settings below, before jax starts; returns the device count set (or None)."""
    prefer_wide_vectors(environ)
    return emulate_cpu_devices(environ)


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
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
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
