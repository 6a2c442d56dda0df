"""Execution helpers around ``apply`` that change speed, never the arithmetic of a row.

- ``cast_matmul_kernels``: matmul kernels stored once in the compute dtype. ``dot`` casts its
  weight to the compute dtype on every call; with f32 parameters and bf16 compute that re-cast
  is a full pass over the weights per forward. Pre-cast kernels give the
  same bf16 values, so the outputs are those of ``apply`` on the original parameters. Norm
  scales, biases, embeddings and the MAP probe stay as they are (they are read in f32).
- ``chunked_apply``: the batch processed in sequential chunks (a loop), so every GEMM has at
  most ``chunk`` images' rows. XLA:CPU's bf16 GEMM loses a third of its speed at ViT-B/16's
  batch-32 shapes (M = 6304 rows); in chunks of a few images it keeps it. Rows never interact
  in a ViT, so each row's result is the unchunked one. With the batch sharded over ``shards``
  devices (the mesh's data axis) every chunk takes ``chunk`` rows from each shard: the
  reshape [B] -> [shards, n, chunk] -> [n, shards * chunk] keeps every row on its device.
  Given ``active``, only that many leading steps run (a loop with a trip count known at run
  time, one program for every count): a batch padded to its bucket skips the steps that hold
  padding alone, where the caller puts each shard's images in its leading rows.
- ``from_levels``: uint8 pixel levels normalised inside the forward, step by step, by the pixel
  contract's table (``model.pixels.level_table``): the host sends a quarter of the bytes and
  skips a pass over every image, and the values are the host's own, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import ViTConfig
from .vit import AS_WRITTEN, CONTRACTED_AXES, Execution, OutputRequest, apply

# Every parameter that only ever enters ``dot`` as its weight (model/vit.py).
MATMUL_KERNELS = frozenset(
    {
        "patch_embed",
        "w_in",
        "w_out",
        "w_qkv",
        "w_o",
        "w_fc1",
        "w_gate",
        "w_fc2",
        "w_q",
        "w_kv",
        "projection",
        "classifier",
    }
)


def _name(path) -> str:
    last = path[-1]
    return str(getattr(last, "key", getattr(last, "name", last)))


def cast_matmul_kernels(cfg: ViTConfig, params):
    """``params`` with every matmul kernel in ``cfg.compute_dtype`` (others untouched).

    Works on concrete arrays (device or host) and on abstract ``ShapeDtypeStruct`` trees;
    a sharded array keeps its sharding.
    """
    dtype = jnp.dtype(cfg.compute_dtype)

    def cast(path, leaf):
        if _name(path) not in MATMUL_KERNELS or leaf.dtype == dtype:
            return leaf
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=leaf.sharding)
        return leaf.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, params)


def store_transposed(params, names: frozenset[str]):
    """``params`` with the kernels ``names`` stored with their contracted axes last
    (``vit.kernel``); for ``apply`` with ``Execution(transposed=names)``."""

    def move(path, leaf):
        name = _name(path)
        if name not in names:
            return leaf
        c = CONTRACTED_AXES[name]
        axes = tuple(range(c, leaf.ndim)) + tuple(range(c))
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(tuple(leaf.shape[a] for a in axes), leaf.dtype)
        return jnp.transpose(leaf, axes)

    return jax.tree_util.tree_map_with_path(move, params)


def from_levels(table, images: jax.Array) -> jax.Array:
    """uint8 levels [..., C] -> float32 by ``table`` [C, 256] (one look-up per value).

    A look-up and not the formula: XLA compiles a division by a constant into a multiplication
    by its reciprocal, which rounds differently from the host's division."""
    channels = images.shape[-1]
    index = images.astype(jnp.int32) + 256 * jnp.arange(channels, dtype=jnp.int32)
    return jnp.asarray(table, jnp.float32).reshape(-1).at[index].get(mode="clip")


def chunked_apply(
    cfg: ViTConfig,
    params,
    images: jax.Array,
    request: OutputRequest,
    chunk: int,
    shards: int = 1,
    pos: jax.Array | None = None,
    execution: Execution = AS_WRITTEN,
    active: jax.Array | None = None,
    levels=None,
) -> dict:
    """``apply`` over ``images`` [B, ...] in ``B / (shards * chunk)`` sequential steps.

    ``shards`` is the number of contiguous blocks the batch is split into (the data axis of its
    sharding); ``chunk`` images are taken from each block per step. Both must divide B.
    ``pos``: the position table at the images' grid (``vit.position_table``); ``execution``:
    as ``apply``'s. ``active``: an int32 scalar, run only the first ``active`` steps (rows
    ``[i * chunk, (i + 1) * chunk)`` of every shard for step i); the skipped steps' rows come
    back as zeros. None: every step. ``levels``: ``images`` are uint8 pixel levels, normalised
    by this [C, 256] table in each step (``from_levels``); None: they are normalised already.
    """
    if (images.dtype == jnp.uint8) != (levels is not None):
        table = "no" if levels is None else "a"
        raise ValueError("uint8 images need the normalisation's table (levels), normalised ones "
                         f"none; got {images.dtype} images and {table} table")
    b = images.shape[0]
    if chunk <= 0 or b % (shards * chunk):
        raise ValueError(
            f"a batch of {b} images does not split into chunks of {chunk} images "
            f"on each of {shards} shards"
        )
    steps = b // (shards * chunk)

    def step(x):
        x = x if levels is None else from_levels(levels, x)
        return apply(cfg, params, x, request, pos, execution)

    if steps == 1:
        return step(images)

    def to_steps(x):  # [B, ...] -> [steps, shards * chunk, ...]
        x = x.reshape(shards, steps, chunk, *x.shape[1:]).swapaxes(0, 1)
        return x.reshape(steps, shards * chunk, *x.shape[3:])

    def from_steps(y):  # [steps, shards * chunk, ...] -> [B, ...]
        y = y.reshape(steps, shards, chunk, *y.shape[2:]).swapaxes(0, 1)
        return y.reshape(b, *y.shape[3:])

    xs = to_steps(images)

    def body(i, out):
        y = step(jax.lax.dynamic_index_in_dim(xs, i, keepdims=False))
        return jax.tree.map(lambda buf, v: jax.lax.dynamic_update_index_in_dim(buf, v, i, 0),
                            out, y)

    shapes = jax.eval_shape(step, xs[0])
    out = jax.tree.map(lambda s: jnp.zeros((steps, *s.shape), s.dtype), shapes)
    count = steps if active is None else jnp.clip(active, 0, steps)
    out = jax.lax.fori_loop(0, count, body, out)
    return jax.tree.map(from_steps, out)
