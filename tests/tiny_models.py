"""Tiny models for the sharding, checkpoint and import tests (8 heads: every 8-device mesh fits)."""

import numpy as np
from vit22b.model import ViTConfig, get_config
from vit22b.model.checkpoint import expected_shapes, unflatten

# f32 compute, so that sharded and single-device outputs agree to rounding.
PARALLEL = get_config("vit-22b-tiny/16").replace(
    name="tiny-parallel-8h", heads=8, depth=3, compute_dtype="float32"
)
# a standard ViT (sequential blocks, LayerNorm, CLS token) at the same scale
SEQUENTIAL = get_config("vit-ti/16").replace(
    name="tiny-seq-8h",
    width=64,
    depth=2,
    heads=8,
    mlp_dim=128,
    patch=8,
    image_size=32,
    compute_dtype="float32",
)


def random_params(cfg: ViTConfig, seed: int = 0) -> dict:
    """Host (numpy) parameters of the right shapes, without compiling an init."""
    rng = np.random.default_rng(seed)
    return unflatten(
        {
            path: (0.1 * rng.standard_normal(shape)).astype(dtype)
            for path, (shape, dtype) in expected_shapes(cfg).items()
        }
    )


def images(cfg: ViTConfig, n: int = 8, seed: int = 7) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, cfg.image_size, cfg.image_size, cfg.channels), np.float32)
