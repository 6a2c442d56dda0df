"""Mesh construction and the sharding rules of the backbone.

Batch over ``data``; heads and MLP hidden over ``model`` (whole heads per shard, thanks to the
head-grouped layout); embeddings, norms and the classifier replicated; the
MAP head is split like a block. Parameters are created directly in
their sharding by a jitted init with ``out_shardings``: nothing holds the whole model on one device.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .config import ViTConfig
from .host import available_memory
from .vit import abstract_params, init_params

AXES = ("data", "model")


class MeshError(ValueError):
    """A mesh spec that cannot be built or does not fit the model."""


def parse_mesh_spec(spec: str, num_devices: int) -> tuple[int, int]:
    """``'data=2,model=4'`` (either axis may be omitted and is then inferred), or ``'auto'``."""
    spec = spec.strip()
    if spec in ("", "auto"):
        return num_devices, 1
    sizes: dict[str, int] = {}
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(data|model)\s*=\s*([0-9]+)\s*", part)
        if not match:
            raise MeshError(
                f"bad mesh spec {spec!r}: expected 'data=N,model=M' (or 'auto'), got {part!r}"
            )
        sizes[match[1]] = int(match[2])
    if any(v <= 0 for v in sizes.values()):
        raise MeshError(f"bad mesh spec {spec!r}: axis sizes must be positive")
    if "data" not in sizes:
        sizes["data"] = max(num_devices // sizes["model"], 1)
    if "model" not in sizes:
        sizes["model"] = max(num_devices // sizes["data"], 1)
    if sizes["data"] * sizes["model"] != num_devices:
        raise MeshError(
            f"mesh {spec!r} needs data*model = {sizes['data']}*{sizes['model']} = "
            f"{sizes['data'] * sizes['model']} devices, but {num_devices} are available"
        )
    return sizes["data"], sizes["model"]


def make_mesh(spec: str = "auto", devices: list | None = None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    data, model = parse_mesh_spec(spec, len(devices))
    return Mesh(np.asarray(devices).reshape(data, model), AXES)


def mesh_spec(mesh: Mesh) -> str:
    return ",".join(f"{name}={size}" for name, size in mesh.shape.items())


def check_mesh_fits(cfg: ViTConfig, mesh: Mesh | Mapping[str, int]) -> None:
    """Refuse a model axis that would cut through heads or the MLP hidden (a mesh, or the axis
    sizes of one that need not exist: ``vit22b info``)."""
    model = (mesh.shape if isinstance(mesh, Mesh) else mesh)["model"]
    if cfg.heads % model:
        raise MeshError(
            f"{cfg.name}: the mesh's model axis ({model}) does not divide heads ({cfg.heads})"
        )
    if cfg.mlp_dim % model:
        raise MeshError(
            f"{cfg.name}: the mesh's model axis ({model}) does not divide mlp_dim ({cfg.mlp_dim})"
        )


# Which axis of each block parameter is split over ``model``; everything else is replicated.
_MODEL_AXIS = {
    "w_in": 1,  # [d, H, 3hd + M/H]
    "b_qkv": 0,  # [H, 3hd]
    "b_mlp": 0,  # [H, M/H]
    "w_out": 0,  # [H, hd + M/H, d]
    "w_qkv": 1,  # [d, H, 3hd]
    "w_o": 0,  # [H, hd, d]
    "w_fc1": 1,  # [d, M]
    "b_fc1": 0,  # [M]
    "w_gate": 1,  # SwiGLU's gate [d, M]
    "b_gate": 0,  # [M]
    "w_fc2": 0,  # [M, d]
    "w_q": 1,  # MAP head [d, H, hd]
    "b_q": 0,  # [H, hd]
    "w_kv": 1,  # [d, H, 2hd]
    "b_kv": 0,  # [H, 2hd]
}
# The MAP head of a 22B model is as large as a block (0.9 GB in bf16): split it the same way.
_SHARDED_SCOPES = ("block_", "map_head")


def param_spec(path: tuple[str, ...], ndim: int) -> P:
    """Partition spec of one parameter, from its path in the tree."""
    sharded_scope = bool(path) and path[0].startswith(_SHARDED_SCOPES)
    axis = _MODEL_AXIS.get(path[-1]) if sharded_scope else None
    if axis is None:
        return P()
    spec = [None] * ndim
    spec[axis] = "model"
    return P(*spec)


def _path_names(path) -> tuple[str, ...]:
    return tuple(getattr(k, "key", getattr(k, "name", str(k))) for k in path)


def param_specs(params) -> dict:
    """The partition-spec tree for a (concrete or abstract) parameter tree."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: param_spec(_path_names(path), len(leaf.shape)), params
    )


def param_shardings(cfg: ViTConfig, mesh: Mesh, params=None) -> dict:
    check_mesh_fits(cfg, mesh)
    params = abstract_params(cfg) if params is None else params
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(params))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P("data"))


def init_sharded(cfg: ViTConfig, mesh: Mesh, seed: int = 0) -> dict:
    """Seeded random parameters materialised directly in their sharding."""
    check_host_memory(cfg, mesh)
    # the compute dtype shapes the forward init runs, never the parameters it returns
    return _initializer(cfg.replace(compute_dtype="float32"), mesh)(jax.random.key(seed))


@functools.lru_cache(maxsize=16)
def _initializer(cfg: ViTConfig, mesh: Mesh):
    """The compiled init of ``cfg`` on ``mesh``, kept for the process: XLA:CPU compiles each
    parameter's random draw on its own (most of `vit22b init`'s time for the tiny preset:
    benchmarks/startup.py, cold against warm), and a process that loads a preset again (a
    notebook, the test suite) would pay that each time."""
    return jax.jit(functools.partial(init_params, cfg), out_shardings=param_shardings(cfg, mesh))


def shard_params(cfg: ViTConfig, params, mesh: Mesh) -> dict:
    """Place an existing parameter tree (host or device) onto the mesh."""
    return jax.device_put(params, param_shardings(cfg, mesh, params))


def bytes_per_device(cfg: ViTConfig, mesh_shape: dict[str, int], dtype: str | None = None) -> int:
    """The largest device's share of the parameters, from abstract shapes and the rules above."""
    params = abstract_params(cfg)
    specs = param_specs(params)
    total = 0
    for leaf, spec in zip(jax.tree.leaves(params), jax.tree.leaves(specs, is_leaf=_is_spec)):
        itemsize = np.dtype(dtype or leaf.dtype).itemsize
        shard = list(leaf.shape)
        for axis, name in enumerate(spec):
            if name is not None:
                shard[axis] = -(-shard[axis] // mesh_shape[name])
        total += math.prod(shard) * itemsize
    return total


def check_host_memory(cfg: ViTConfig, mesh: Mesh) -> None:
    """Refuse a model whose parameters alone exceed this host's available memory, where they
    live in it (CPU devices: each of this process's devices holds its shard, so every data
    replica a copy). Past it the allocations need not fail (Linux overcommits memory): the
    kernel's OOM killer would end the process later, with no message."""
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    if not local or local[0].platform != "cpu":
        return
    need = bytes_per_device(cfg, dict(mesh.shape)) * len(local)
    have = available_memory()
    if have is not None and need > have:
        shape = ",".join(f"{axis}={n}" for axis, n in mesh.shape.items())
        copies = "; each data replica holds a copy" if mesh.shape["data"] > 1 else ""
        one_copy = need // mesh.shape["data"]
        remedy = "fewer data replicas (--mesh data=1) or " if copies and one_copy <= have else ""
        raise MeshError(
            f"{cfg.name} does not fit this host's memory: its {cfg.param_dtype} parameters take "
            f"{need / 2**30:.1f} GiB on this process's CPU devices (mesh {shape}{copies}) and "
            f"{have / 2**30:.1f} GiB is available; it needs {remedy}a host with more memory")


def _is_spec(x) -> bool:
    return isinstance(x, P)
