"""Position encodings at any patch grid (rows x cols), each the way its source computes it.

jax-free (numpy): the tables are constants per grid, computed once per grid (the engine caches
the resampled learned table per grid; sin-cos and RoPE tables are baked into each compiled
forward) and testable against the sources' own code without a model.

Learned tables are resampled as the checkpoint's source does at a grid other than its own
(``ViTConfig.posemb_resample``):

- ``bicubic``: ``F.interpolate(mode="bicubic", align_corners=False)`` on the [d, gh, gw] grid
  (Keys' cubic, A = -0.75, border taps clamped): Hugging Face ``ViTModel`` and ``Dinov2Model``
  with ``interpolate_pos_encoding`` (transformers 5.x: ``size=``, no offset);
- ``bicubic_antialias``: the same call with ``antialias=True`` (A = -0.5, support widened by the
  scale when shrinking, weights renormalised at the borders): timm's
  ``resample_abs_pos_embed`` (``dynamic_img_size=True``) and Hugging Face
  ``Dinov2WithRegistersModel``;
- ``none``: the table is used at its own grid only.

Both resamples are separable: torch runs the width pass, then the height pass, each in float32,
skipping an axis whose size is unchanged; the sources return the table untouched at its own grid.
The weights here are computed in float32 by torch's index arithmetic
(aten/src/ATen/native/UpSample.h, cpu/UpSampleKernel.cpp).
"""

from __future__ import annotations

import functools
import math

import numpy as np

Grid = tuple[int, int]  # (rows, cols) of patches
RESAMPLE_METHODS = ("bicubic", "bicubic_antialias", "none")
F32 = np.float32


def _cubic(x: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution kernel at |x| (0 beyond 2)."""
    x = np.abs(x).astype(F32)
    a = F32(a)
    near = ((a + F32(2)) * x - (a + F32(3))) * x * x + F32(1)
    far = ((a * x - F32(5) * a) * x + F32(8) * a) * x - F32(4) * a
    return np.where(x < 1, near, np.where(x < 2, far, F32(0))).astype(F32)


@functools.lru_cache(maxsize=256)
def resample_weights(n_in: int, n_out: int, method: str) -> np.ndarray:
    """The [n_out, n_in] float32 matrix of one axis of torch's bicubic resize (size=n_out,
    align_corners=False); the identity when the size is unchanged (torch skips that axis)."""
    if method not in RESAMPLE_METHODS[:2]:
        raise ValueError(f"no resampling for method {method!r}")
    w = np.zeros((n_out, n_in), F32)
    if n_in == n_out:
        np.fill_diagonal(w, 1)
        return w
    scale = F32(n_in) / F32(n_out)
    for i in range(n_out):
        if method == "bicubic":
            real = scale * (F32(i) + F32(0.5)) - F32(0.5)
            base = math.floor(real)
            t = F32(real - F32(base))
            taps = _cubic(np.array([t + 1, t, 1 - t, 2 - t], F32), -0.75)
            for j, weight in zip(range(base - 1, base + 3), taps):
                w[i, min(max(j, 0), n_in - 1)] += weight
        else:  # antialiased: PIL's cubic (A = -0.5) stretched by the scale when shrinking
            support = F32(2) * scale if scale >= 1 else F32(2)
            invscale = F32(1) / scale if scale >= 1 else F32(1)
            centre = scale * (F32(i) + F32(0.5))
            lo = max(int(centre - support + F32(0.5)), 0)
            hi = min(int(centre + support + F32(0.5)), n_in)
            js = np.arange(lo, hi)
            taps = _cubic((js.astype(F32) - centre + F32(0.5)) * invscale, -0.5)
            total = taps.sum(dtype=F32)
            w[i, lo:hi] = taps / total if total != 0 else taps
    return w


def resample_table(table: np.ndarray, old: Grid, new: Grid, method: str) -> np.ndarray:
    """A learned patch table [gh * gw, d] at grid ``old`` -> [rows * cols, d] at ``new``."""
    if tuple(new) == tuple(old):
        return table
    if method == "none":
        raise ValueError(
            f"this model's position table is for a {old[0]}x{old[1]} grid only "
            f"(posemb_resample='none'); {new[0]}x{new[1]} was asked for"
        )
    d = table.shape[-1]
    grid = np.asarray(table, F32).reshape(old[0], old[1], d)
    wy = resample_weights(old[0], new[0], method)
    wx = resample_weights(old[1], new[1], method)
    grid = np.einsum("xj,ijd->ixd", wx, grid.astype(np.float64)).astype(F32)  # width pass
    grid = np.einsum("yi,ixd->yxd", wy, grid.astype(np.float64)).astype(F32)  # height pass
    return grid.reshape(new[0] * new[1], d)


@functools.lru_cache(maxsize=64)
def sincos2d(rows: int, cols: int, width: int, temperature: float = 10_000.0) -> np.ndarray:
    """Fixed 2-D sine-cosine table [rows * cols, width] (MoCo v3 / big_vision's
    ``posemb_sincos_2d(h, w, width)``): x and y are the patch's column and row index."""
    if width % 4:
        raise ValueError(f"sincos2d position embedding needs width divisible by 4, got {width}")
    y, x = np.mgrid[:rows, :cols]
    omega = 1.0 / temperature ** (np.arange(width // 4) / (width // 4 - 1 or 1))
    y = y.reshape(-1)[:, None] * omega[None]
    x = x.reshape(-1)[:, None] * omega[None]
    table = np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1)
    return table.astype(F32)


@functools.lru_cache(maxsize=64)
def rope_tables(rows: int, cols: int, head_dim: int, theta: float) -> tuple[np.ndarray, ...]:
    """DINOv3's 2-D rotary embedding: cos and sin [rows * cols, head_dim] for the patches.

    Patch centres at ((i + 0.5) / n) * 2 - 1 per axis, each axis normalised by its own count
    (Hugging Face ``get_patches_center_coordinates``); ``head_dim / 4`` frequencies
    ``theta ** -(4k / head_dim)``; angles 2 pi (y | x) f, repeated twice along the head dim (the
    rotate-half pairing).
    """
    ys = np.arange(0.5, rows, dtype=F32) / F32(rows) * F32(2) - F32(1)
    xs = np.arange(0.5, cols, dtype=F32) / F32(cols) * F32(2) - F32(1)
    yx = np.stack(np.meshgrid(ys, xs, indexing="ij"), -1).reshape(-1, 2)
    inv_freq = 1.0 / theta ** np.arange(0, 1, 4 / head_dim, dtype=F32)
    angles = (2 * np.pi * yx[:, :, None] * inv_freq[None, None]).reshape(len(yx), -1)
    angles = np.tile(angles.astype(F32), 2)
    return np.cos(angles), np.sin(angles)
