"""What this host can give a process, read without jax (the converters, the probes' file
readers and the mesh all ask before they allocate)."""

from __future__ import annotations

import contextlib
from pathlib import Path


def available_memory(cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process may still allocate: /proc/meminfo's MemAvailable, or less under the
    memory limit of its cgroup (a container's: v2 ``memory.max``, v1 ``limit_in_bytes``, each
    less its working set: the usage but the inactive file cache, which the kernel reclaims, as
    MemAvailable counts it); None where none can be read."""
    found = []
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    for limit, usage, stat, cache in (
            ("memory.max", "memory.current", "memory.stat", "inactive_file"),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
             "memory/memory.stat", "total_inactive_file")):
        with contextlib.suppress(OSError, ValueError):
            cap = (cgroup / limit).read_text().strip()  # "max": no limit
            if not cap.isdigit():
                continue
            stats = dict(line.split() for line in (cgroup / stat).read_text().splitlines())
            used = int((cgroup / usage).read_text()) - int(stats.get(cache, 0))
            found.append(max(int(cap) - used, 0))
    return min(found) if found else None
