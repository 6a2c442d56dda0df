"""Emulated CPU devices for data parallelism on a CPU host; must run before jax is imported.

XLA:CPU runs one program on a host's cores; in float32 two programs on two emulated devices
(the batch split over the mesh's data axis) keep both cores of a 2-core host busy where one
does not (server/plan.py). The device count is fixed when jax starts, so the server's
command line asks for the devices before anything imports jax. A count the user set in
``XLA_FLAGS`` wins; on a GPU or TPU host the flag changes only the (unused) CPU platform.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

from .plan import CPU_DEVICES

FLAG = "--xla_force_host_platform_device_count"


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
