"""Attention diagnostics from the served statistics: entropy and max logit per layer and head.

The ViT-22B paper traced its training divergence to attention logits growing without bound,
which collapses the attention entropy of some heads toward zero (one-hot attention). The model
reports, per image, each head's mean attention entropy over queries and its largest logit
([N, depth, heads]); this probe summarises them per layer and head and flags collapsed heads.
"""

from __future__ import annotations

import numpy as np

from .data import DataError


def attention_diagnostics(
    entropy: np.ndarray,
    max_logit: np.ndarray,
    num_tokens: int | None = None,
    collapse_fraction: float = 0.1,
) -> dict:
    """Per layer and head: entropy mean / std / min and max-logit mean / max over images.

    A head is flagged as collapsed when its mean entropy is below ``collapse_fraction`` of the
    uniform-attention entropy ``log(num_tokens)`` (needs ``num_tokens``).
    """
    entropy, max_logit = np.asarray(entropy, np.float64), np.asarray(max_logit, np.float64)
    if entropy.ndim != 3 or entropy.shape != max_logit.shape:
        raise DataError(
            f"attention statistics must both be [N, depth, heads]; got entropy {entropy.shape} "
            f"and max logit {max_logit.shape}"
        )
    depth, heads = entropy.shape[1:]
    if not (depth and heads):
        raise DataError(f"attention statistics of shape {list(entropy.shape)} hold no layer "
                        "or no head")
    if entropy.min() < 0:  # an entropy is >= 0: another array saved under its name
        raise DataError(f"attention entropy holds negative values (down to {entropy.min():.3g}):"
                        " not an entropy")
    mean_entropy = entropy.mean(0)
    report = {
        "probe": "diagnostics",
        "num_images": entropy.shape[0],
        "depth": depth,
        "heads": heads,
        "entropy_mean": mean_entropy.tolist(),  # [depth][heads]
        "entropy_std": entropy.std(0).tolist(),
        "entropy_min": entropy.min(0).tolist(),
        "max_logit_mean": max_logit.mean(0).tolist(),
        "max_logit_max": max_logit.max(0).tolist(),
        "per_layer": [
            {
                "layer": layer,
                "entropy_mean": float(mean_entropy[layer].mean()),
                "lowest_entropy_head": int(mean_entropy[layer].argmin()),
                "max_logit_max": float(max_logit[:, layer].max()),
            }
            for layer in range(depth)
        ],
    }
    if num_tokens:
        uniform = float(np.log(num_tokens))
        collapsed = np.argwhere(mean_entropy < collapse_fraction * uniform)
        report["uniform_entropy"] = uniform
        report["collapsed_heads"] = [{"layer": int(a), "head": int(b)} for a, b in collapsed]
    else:  # said, not left out: an absent list would read as "no head collapsed"
        report["uniform_entropy"] = report["collapsed_heads"] = None
        report["collapse_not_judged"] = (
            "the feature source does not say over how many tokens attention ran, so no head's "
            "entropy is set against uniform attention")
    return report
