"""Parity of a converted backbone with its source's own forward on the same pixels.

Float32 compute must agree to ``TOL_F32`` relative (the whole array's ||a - b|| / ||b||) on every
output the source gives (pooled, last-layer patch tokens, register tokens, the pre-projection
feature); bfloat16 compute is measured against the same reference and must stay within
``TOL_BF16``. With ``VIT22B_PARITY_OUT`` set, every figure is appended to that file as one JSON
line (``python benchmarks/parity.py`` turns them into the README's tables); ``record`` writes the
processor-parity figures of tests/test_processor_parity.py the same way.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from peers import rel_err
from vit22b.model import OutputRequest, apply

# Our forward compiled whole, as the engine runs it. Run op by op instead, a model of a new shape
# compiles every operation as its own small program, about 67 ms each on XLA:CPU here
# (benchmarks/compile_cost.py).
compiled_apply = jax.jit(apply, static_argnums=(0, 3))

TOL_F32 = 1e-5
TOL_BF16 = 5e-2  # bf16 matmul inputs: about 3e-3 per matmul, compounded over the tiny depth


def our_outputs(converted, pixels_nhwc: np.ndarray, dtype: str, request: OutputRequest) -> dict:
    cfg = converted.config.replace(compute_dtype=dtype)
    out = compiled_apply(cfg, converted.params, pixels_nhwc, request)
    flat = {k: v for k, v in out.items() if k != "patch_tokens"}
    flat["patch_tokens"] = out.get("patch_tokens", {}).get(cfg.depth - 1)
    return flat


def record(row: dict) -> None:
    """One measured figure, as a JSON line of ``VIT22B_PARITY_OUT`` when it is set."""
    out = os.environ.get("VIT22B_PARITY_OUT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def check_parity(case: str, source: str, converted, pixels_nchw, peer: dict, norm_patches: bool):
    """``peer``: {'pooled', 'patch_tokens' (last layer), 'register_tokens', 'pre_projection',
    'logits'} (those the source gives) as numpy arrays; ``norm_patches``: whether its patch
    tokens are after the final norm. Returns {output: (f32 error, bf16 error)}."""
    request = OutputRequest(
        pooled="pooled" in peer,
        patch_layers=(-1,) if "patch_tokens" in peer else (),
        norm_patches=norm_patches and "patch_tokens" in peer,
        register_tokens="register_tokens" in peer,
        pre_projection="pre_projection" in peer,
        logits="logits" in peer,
    )
    pixels = np.asarray(pixels_nchw).transpose(0, 2, 3, 1)
    f32 = our_outputs(converted, pixels, "float32", request)
    bf16 = our_outputs(converted, pixels, "bfloat16", request)
    figures = {
        name: (rel_err(f32[name], ref), rel_err(bf16[name], ref)) for name, ref in peer.items()
    }
    for name, (e32, e16) in figures.items():
        record({"case": case, "source": source, "output": name, "f32": e32, "bf16": e16})
    for name, (e32, e16) in figures.items():
        assert e32 < TOL_F32, f"{case}: {name} differs from the source by {e32:.2e} in float32"
        assert e16 < TOL_BF16, f"{case}: {name} differs from the source by {e16:.2e} in bfloat16"
    return figures
