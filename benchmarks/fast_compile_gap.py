"""How far the tests' fast compile (LLVM -O0, tests/xla_env.py) rounds from the default one.

    python benchmarks/fast_compile_gap.py

Runs the tests' ``tiny_features`` (two tiny models' pooled and patch features, float32 and
bfloat16; tests/test_model.py) in two processes, one with the tests' flag and one without, and
reports each output's relative error between them (the tests' ``rel_err``). Ends with one JSON
line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from benchlib import emit, log, machine

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))
from peers import rel_err  # noqa: E402
from xla_env import FAST_COMPILE  # noqa: E402

CHILD = "import sys, numpy as np; from test_model import tiny_features; " \
        "np.savez(sys.argv[1], **tiny_features())"


def features(flags: str, path: Path) -> dict[str, np.ndarray]:
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", CHILD, str(path)], env=env, cwd=TESTS, check=True)
    with np.load(path) as saved:
        return dict(saved)


def main() -> int:
    devices = "--xla_force_host_platform_device_count=8"
    with tempfile.TemporaryDirectory() as work:
        fast = features(f"{FAST_COMPILE} {devices}", Path(work) / "fast.npz")
        default = features(devices, Path(work) / "default.npz")
    gaps = {key: float(f"{rel_err(fast[key], default[key]):.2e}") for key in sorted(fast)}
    log(f"relative error, -O0 against the default compile: {gaps}")
    emit({"benchmark": "fast_compile_gap", "rel_err": gaps, "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
