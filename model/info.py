"""Sizes of a model from abstract shapes: parameters, FLOPs, bytes. Never allocates the weights."""

from __future__ import annotations

import math
import re

import jax

from .config import ViTConfig
from .sharding import MeshError, bytes_per_device, check_mesh_fits, parse_mesh_spec
from .vit import abstract_params

# Parameters outside the encoder: the pooling head and the classifier. The paper's 21.7B (and
# timm's counts without the head) are encoder parameters.
_HEAD_SCOPES = ("map_head", "projection", "classifier", "classifier_bias")


def count(tree) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def model_info(cfg: ViTConfig, mesh: str | None = None, dtype: str | None = None) -> dict:
    params = abstract_params(cfg)
    total = count(params)
    head = count({k: v for k, v in params.items() if k in _HEAD_SCOPES})
    info = {
        "model": cfg.name,
        "param_count": total - head,
        "head_param_count": head,
        "total_param_count": total,
        "params_per_block": count(params["block_0"]),
        "flops_per_image": cfg.flops_per_image(),
        "tokens": cfg.num_tokens,
        "image_size": cfg.image_size,
        "width": cfg.width,
        "depth": cfg.depth,
        "heads": cfg.heads,
        "bytes_float32": 4 * total,
        "bytes_bfloat16": 2 * total,
    }
    if mesh is not None:
        data, model = parse_mesh_spec(mesh, _devices_in(mesh))
        axes = {"data": data, "model": model}
        check_mesh_fits(cfg, axes)  # what serve refuses, info refuses too
        info["mesh"] = axes
        info["bytes_per_device"] = bytes_per_device(cfg, axes, dtype)
        info["bytes_per_device_dtype"] = dtype or cfg.param_dtype
    return info


def _devices_in(mesh: str) -> int:
    """Device count implied by an explicit spec (info never needs the devices to exist)."""
    sizes = re.fullmatch(r"\s*data\s*=\s*([0-9]+)\s*,\s*model\s*=\s*([0-9]+)\s*", mesh)
    if not sizes:
        raise MeshError(f"--mesh for info needs both axes, e.g. data=1,model=8; got {mesh!r}")
    return int(sizes[1]) * int(sizes[2])
