"""The XLA_FLAGS of the tests' processes: emulated CPU devices, and LLVM's optimisation of
XLA:CPU's generated code turned off; and a way to run code as users' processes compile it.

The suite compiles hundreds of small programs, and LLVM's optimisation of the code XLA:CPU
generates for them is about a quarter of its time (`benchmarks/NOTES.md`, "The suite at LLVM's
-O0"). The HLO passes (fusion, layouts, sharding) and the GEMM libraries are the production
programs'; what changes is instruction selection: at -O0 no multiply and add are fused into one
FMA, so elementwise results differ from the production compile's by rounding (the exact GELU at
-8 is 4.8e-7 where float64's is -5e-15; `benchmarks/fast_compile_gap.py` measures the gap on
whole models).
Every process a test starts gets the same flags, so bit-for-bit comparisons across processes
hold; the tests that measure rounding itself, and one that bounds the two compiles' difference
on whole models, run at the production level (``run_at_production_level``). Benchmarks, `make
demo` and users' servers keep XLA's default.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

FAST_COMPILE = "--xla_backend_optimization_level=0"
TESTS = Path(__file__).resolve().parent


def xla_flags(devices: int) -> str:
    return f"{FAST_COMPILE} --xla_force_host_platform_device_count={devices}"


def production_env() -> dict[str, str]:
    """This process's environment without the tests' fast compile: a process started with it
    compiles as a user's does (the emulated devices kept)."""
    flags = os.environ.get("XLA_FLAGS", "").replace(FAST_COMPILE, "")
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, XLA_FLAGS=" ".join(flags.split()), PYTHONPATH=path)


def run_at_production_level(code: str, *args: str) -> None:
    """``python -c code *args`` compiled as users' processes compile (this one compiles at the
    tests' level: the two differ); fails the test on a non-zero exit, with the child's stderr."""
    env = production_env()
    assert FAST_COMPILE in os.environ["XLA_FLAGS"] and "optimization_level" not in env["XLA_FLAGS"]
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
