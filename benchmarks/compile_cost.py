"""What one XLA:CPU compile costs here, and what running a model op by op costs against compiling
it whole (the test suite's time, benchmarks/NOTES.md).

    python benchmarks/compile_cost.py

Each side runs in a fresh process (so no compile is shared), with JAX's persistent cache off and
on (an empty folder: every compile a miss). Prints one JSON line per side:
- ``tanh_compile_ms``: ``jax.jit(tanh).lower(x).compile()`` at 15 new shapes, mean;
- ``eager_op_ms``: one eagerly run operation at a new shape, mean over 150;
- ``init_eager_s`` / ``init_compiled_s``: ``init_params`` of a 2-deep tiny model of a new width
  run op by op (``jax.disable_jit``) and compiled whole.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def _measure(cache: bool) -> dict:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"  # as the tests
    import jax
    import jax.numpy as jnp
    from vit22b.model import get_config, init_params

    if cache:
        jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp())
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    tanh = jax.jit(jnp.tanh)
    start = time.perf_counter()
    for n in range(1, 16):
        tanh.lower(jnp.ones((n, 5))).compile()
    tanh_ms = (time.perf_counter() - start) / 15 * 1e3
    start = time.perf_counter()
    for n in range(1, 31):  # five operations at each new shape
        (jnp.tanh(jnp.ones((n, 7))) * 2 + 1).sum(0).block_until_ready()
    op_ms = (time.perf_counter() - start) / 150 * 1e3
    times = {}
    for side, width in (("init_eager_s", 40), ("init_compiled_s", 48)):
        cfg = get_config("vit-22b-tiny/16").replace(width=width, mlp_dim=2 * width, depth=2)
        start = time.perf_counter()
        if side == "init_eager_s":
            with jax.disable_jit():
                jax.block_until_ready(init_params(cfg, jax.random.key(0)))
        else:
            jax.block_until_ready(init_params(cfg, jax.random.key(0)))
        times[side] = round(time.perf_counter() - start, 2)
    return {"cache": cache, "tanh_compile_ms": round(tanh_ms, 1), "eager_op_ms": round(op_ms, 1),
            **times}


def main() -> int:
    if len(sys.argv) > 1:  # one side, in its own process
        print(json.dumps(_measure(sys.argv[1] == "on")))
        return 0
    for side in ("off", "on", "off", "on"):
        run = subprocess.run([sys.executable, __file__, side], capture_output=True, text=True,
                             check=True)
        print(run.stdout.strip().splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
