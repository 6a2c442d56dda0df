"""Block explorer: how QK-norm keeps attention from collapsing as query/key weights grow.

One attention head over a short random token sequence, in the project's own blocks
(``ParallelBlock`` / ``SequentialBlock`` of a one-head ``ViTConfig``). The query and key
projection weights are multiplied by a scale ``s``; without QK-norm the attention logits grow as
``s**2`` and the softmax collapses onto one key (entropy -> 0), the divergence the ViT-22B paper
describes; with QK-norm the normalised queries and keys do not change, nor does the entropy.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from vit22b.model import ViTConfig
from vit22b.model.vit import ParallelBlock, SequentialBlock

DEFAULT_SCALES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
VARIANTS = (("parallel", False), ("parallel", True), ("sequential", False), ("sequential", True))


def variant_name(block: str, qk_norm: bool) -> str:
    return f"{block}/qk_norm={'on' if qk_norm else 'off'}"


def _scaled_qk(params: dict, block: str, head_dim: int, scale: float) -> dict:
    """Params with the query and key slices of the fused projection multiplied by ``scale``."""
    name = "w_in" if block == "parallel" else "w_qkv"
    w = params[name]
    factor = jnp.ones(w.shape[-1]).at[: 2 * head_dim].set(scale)  # [q | k | v (| mlp)]
    return {**params, name: w * factor}


@functools.lru_cache(maxsize=16)
def _sweep(block: str, qk_norm: bool, tokens: int, width: int, batch: int):
    """Jitted (seed, scales) -> per-scale mean entropy and max logit of one block variant."""
    cfg = ViTConfig(
        name="explore", width=width, depth=1, heads=1, mlp_dim=2 * width, block=block,
        qk_norm=qk_norm, compute_dtype="float32",
    )  # fmt: skip
    module = (ParallelBlock if block == "parallel" else SequentialBlock)(cfg)

    def sweep(seed: jax.Array, scales: jax.Array):
        key = jax.random.key(seed)
        x = jax.random.normal(jax.random.fold_in(key, 1), (batch, tokens, width), jnp.float32)
        params = module.init(key, x, True)["params"]

        def at(scale):
            variables = {"params": _scaled_qk(params, block, cfg.head_dim, scale)}
            entropy, max_logit = module.apply(variables, x, True)[1]
            return entropy.mean(), max_logit.max()

        return jax.vmap(at)(scales)

    return jax.jit(sweep)


def explore(
    scales: tuple[float, ...] = DEFAULT_SCALES,
    tokens: int = 8,
    width: int = 32,
    batch: int = 16,
    seed: int = 0,
) -> dict:
    """Mean attention entropy (nats) and max logit of the head for each scale and variant."""
    results = {}
    for block, qk_norm in VARIANTS:
        sweep = _sweep(block, qk_norm, tokens, width, batch)
        entropy, max_logit = sweep(seed, jnp.asarray(scales, jnp.float32))
        results[variant_name(block, qk_norm)] = [
            {"scale": float(s), "entropy": float(e), "max_logit": float(m)}
            for s, e, m in zip(scales, np.asarray(entropy), np.asarray(max_logit))
        ]
    return {
        "probe": "explore",
        "tokens": tokens,
        "width": width,
        "uniform_entropy": math.log(tokens),
        "scales": [float(s) for s in scales],
        "variants": results,
    }


def format_table(report: dict) -> str:
    """Entropy per scale (rows) and variant (columns), as printed by ``vit22b explore``."""
    names = list(report["variants"])
    width = max(len(n) for n in names) + 2
    lines = [
        f"attention entropy (nats; uniform over {report['tokens']} tokens = "
        f"{report['uniform_entropy']:.3f}) vs query/key weight scale",
        f"{'scale':>8}" + "".join(f"{n:>{width}}" for n in names),
    ]
    for i, scale in enumerate(report["scales"]):
        cells = "".join(f"{report['variants'][n][i]['entropy']:>{width}.4f}" for n in names)
        lines.append(f"{scale:>8g}{cells}")
    return "\n".join(lines)
