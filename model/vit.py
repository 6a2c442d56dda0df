"""The vision transformer: the ViT-22B recipe and standard ViTs in one config-driven module.

Layout of a parallel block: the Q, K, V projections and the MLP's first layer
are ONE matmul with a head-grouped kernel ``w_in: [d, H, 3*hd + M/H]``, and the attention
out-projection and the MLP's second layer another, ``w_out: [H, hd + M/H, d]``. Sharding ``H``
over the mesh's ``model`` axis gives each device whole heads plus their MLP slice, so a block
needs exactly one all-reduce (after ``w_out``).

Precision: matmul inputs in ``compute_dtype`` (bf16 by default) with f32 accumulation; residual
stream, softmax and norms in f32. With ``compute_dtype="float32"`` every matmul runs at full f32
precision (``Precision.HIGHEST``: no TF32 or bf16 passes on GPUs and TPUs), so the whole forward
is float32 end to end.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import flax.linen as nn
import jax
import jax.numpy as jnp

from .config import ViTConfig
from .outputs import POOLED, OutputRequest
from .posemb import Grid, resample_weights, rope_tables, sincos2d

Array = jax.Array
F32 = jnp.float32


# ------------------------------------------------------------------------------------------
# numerics shared by every block
# ------------------------------------------------------------------------------------------


def dot(equation: str, x: Array, w: Array, compute_dtype: str, transposed: bool = False) -> Array:
    """einsum with inputs cast to the compute dtype and f32 accumulation (the precision policy).

    ``transposed``: the kernel ``w`` is stored with its contracted axes last (``kernel``); the
    equation still spells them first.
    """
    if transposed:
        inputs, out = equation.split("->")
        xs, ws = inputs.split(",")
        c = sum(axis not in out for axis in ws)
        equation = f"{xs},{ws[c:]}{ws[:c]}->{out}"
    dtype = jnp.dtype(compute_dtype)
    precision = jax.lax.Precision.HIGHEST if dtype == F32 else None
    return jnp.einsum(
        equation, cast(x, dtype), cast(w, dtype), precision=precision, preferred_element_type=F32
    )


def cast(x: Array, dtype) -> Array:
    """``x.astype(dtype)``; float32 -> bfloat16 by rounding the bits to nearest even ourselves:
    the same values as XLA's convert (NaN stays NaN). XLA:CPU's convert took 2.2x as long and
    made the loop it ends (a norm's, the GELU's) 2x slower (benchmarks/NOTES.md)."""
    if x.dtype != F32 or jnp.dtype(dtype) != jnp.bfloat16:
        return x.astype(dtype)
    u32 = jnp.uint32
    bits = jax.lax.bitcast_convert_type(x, u32)
    rounded = bits + u32(0x7FFF) + ((bits >> 16) & u32(1))
    nan = (bits & u32(0x7FFFFFFF)) > u32(0x7F800000)
    bits = jnp.where(nan, bits | u32(0x00400000), rounded)  # quiet NaN, never rounded to inf
    return jax.lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16)


def dot_heads(x: Array, w: Array, compute_dtype: str, transposed: bool = False) -> Array:
    """``bthf,hfd->btd``: the heads and their features contracted as one axis, in that order.

    As an einsum, XLA:CPU contracted (f, h) and transposed both the activations and the
    kernel to match before every call (benchmarks/NOTES.md); the reshapes are free.
    """
    b, t, h, f = x.shape
    w = w.reshape(w.shape[0], h * f) if transposed else w.reshape(h * f, w.shape[-1])
    return dot("btk,kd->btd", x.reshape(b, t, h * f), w, compute_dtype, transposed)


@dataclass(frozen=True)
class Execution:
    """How the forward runs, never what it computes (the engine's plan chooses; the defaults are
    the model as written):

    - ``fold_heads``: attention's heads folded into its batch axis (``attend``), for a mesh that
      does not shard the heads;
    - ``transposed``: the matmul kernels, by name, stored with their contracted axes last
      (``kernel``);
    - ``mlp_slices``: a sequential block's MLP activation and second product in this many slices
      of the tokens, so that each slice's input to that product stays cache-sized (rows do not
      interact: the same numbers).
    """

    fold_heads: bool = False
    transposed: frozenset[str] = field(default_factory=frozenset)
    mlp_slices: int = 1


AS_WRITTEN = Execution()


# The matmul kernels that may be stored transposed (the down projections: the only ones that
# ran faster so, benchmarks/NOTES.md), and how many leading axes of their canonical shape they
# contract. A name means that kernel in every module that has one (a block's, the MAP head's).
CONTRACTED_AXES = {"w_fc2": 1, "w_out": 2}


def kernel(module: nn.Module, name: str, init, shape: tuple[int, ...]) -> Array:
    """The matmul kernel ``name`` of shape ``shape`` (contracted axes first) or, where the
    module's execution names it, stored with its contracted axes last."""
    if name in module.execution.transposed:
        c = CONTRACTED_AXES[name]
        shape = shape[c:] + shape[:c]
    return module.param(name, init, shape, module.cfg.param_dtype)


# erf(x) ~ x P(x^2) / Q(x^2) on [-4, 4]: our rational fit (benchmarks/erf_fit.py prints it and
# its error: 3.1e-7 at most in float32, as jax.lax.erf's). jax's exact GELU goes through erfc
# with exponentials and branches, which XLA:CPU ran 2.2x slower (1.9x as a bf16 matmul input).
ERF_P = (1.12837918, 0.184710302, 0.0543325185, 0.00383951786, 0.000382689074, 4.78045544e-06,
         -1.36663393e-08)
ERF_Q = (1.0, 0.497028789, 0.113826226, 0.0154534824, 0.00130957251, 6.40084768e-05)


def erf(x: Array) -> Array:
    """The error function in float32 (the rational fit above)."""
    x = jnp.clip(x, -4.0, 4.0)  # erf(4) is 1 to float32's precision
    s = x * x
    p = q = 0.0
    for c in reversed(ERF_P):
        p = p * s + c
    for c in reversed(ERF_Q):
        q = q * s + c
    return x * p / q


def gelu(x: Array, exact: bool) -> Array:
    """Exact GELU ``x (1 + erf(x / sqrt 2)) / 2`` (PyTorch's default, its formula), or tanh's."""
    if not exact:
        return jax.nn.gelu(x, approximate=True)  # jax.nn.gelu's default
    return 0.5 * x * (1.0 + erf(x * (1.0 / math.sqrt(2.0))))


def activation(x: Array, cfg: ViTConfig) -> Array:
    """The blocks' MLP nonlinearity (the ungated ones; SwiGLU's silu is applied to its gate)."""
    if cfg.mlp == "quick_gelu":
        return x * jax.nn.sigmoid(1.702 * x)
    return gelu(x, cfg.gelu_exact)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate the last ``len(cos)`` tokens of x [B, T, H, hd]; the prefix tokens stay as is."""
    n = cos.shape[0]
    prefix, patches = x[:, : x.shape[1] - n], x[:, x.shape[1] - n :]
    half = patches.shape[-1] // 2
    rotated = jnp.concatenate([-patches[..., half:], patches[..., :half]], axis=-1)
    patches = patches * cos[None, :, None] + rotated * sin[None, :, None]
    return jnp.concatenate([prefix, patches], axis=1)


def _rope(cfg: ViTConfig, grid: Grid | None, q: Array, k: Array) -> tuple[Array, Array]:
    """RoPE on the patches' queries and keys at ``grid`` (None: the model's own)."""
    if cfg.posemb != "rope":
        return q, k
    grid = grid or (cfg.grid, cfg.grid)
    cos, sin = (jnp.asarray(t) for t in rope_tables(*grid, cfg.head_dim, cfg.rope_theta))
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def attention_entropy(logits: Array) -> Array:
    """Entropy (nats) of softmax(logits) over the last axis, computed stably in f32."""
    logits = logits.astype(F32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


# Queries per step of a long attention: the step's logits then stay cache-sized (at 785 tokens
# 2x faster than all queries at once, at 3137 2.6x; benchmarks/NOTES.md). Shorter ones (224 px
# at patch 14 or 16) run in one step.
QUERY_BLOCK = 128


def attend(q: Array, k: Array, v: Array, compute_dtype: str, stats: bool, fold_heads: bool):
    """Scaled dot-product attention on [B, T, H, hd] tensors.

    Returns the output [B, Tq, H, hd] (f32) and, if ``stats``, per head the mean entropy over
    queries and the maximum logit, each [B, H].

    The heads go next to the batch first, so that XLA:CPU runs both products as contiguous
    batched GEMMs; with ``fold_heads`` they become one batch axis ([B * H, T, hd]), which it
    runs 1.6x faster in bf16 again, but which a mesh sharding both B and H cannot split (the
    engine folds when its model axis is 1). The softmax's normalisation comes after the second
    product: Tq x hd divisions instead of Tq x Tk. Over 2 x ``QUERY_BLOCK`` queries, the
    queries go in steps of about that many (``lax.map``; each query's softmax is over every
    key, so a step is exact). All measured in benchmarks/NOTES.md.
    """
    b, tq, h, hd = q.shape
    q = q * (1.0 / math.sqrt(hd))
    # XLA's own converts here (not ``cast``'s): YNNPACK takes them into its attention fusion.
    q, k, v = (jnp.transpose(t.astype(compute_dtype), (0, 2, 1, 3)) for t in (q, k, v))
    if fold_heads:
        q, k, v = (t.reshape(b * h, *t.shape[2:]) for t in (q, k, v))
    batch = "n" if fold_heads else "bh"

    def rows(queries: Array):  # [..., n, hd] against every key
        logits = dot(f"{batch}qd,{batch}kd->{batch}qk", queries, k, compute_dtype)
        weights = jnp.exp(logits - logits.max(axis=-1, keepdims=True))
        out = dot(f"{batch}qk,{batch}kd->{batch}qd", weights.astype(compute_dtype), v,
                  compute_dtype)
        out = out / weights.sum(axis=-1, keepdims=True)
        return out, (attention_entropy(logits), logits.max(axis=-1)) if stats else None

    if tq <= 2 * QUERY_BLOCK:
        out, st = rows(q)
    else:
        steps = -(-tq // QUERY_BLOCK)
        per_step = -(-tq // steps)
        size = -(-per_step // 8) * 8  # rows of 8: little padding, aligned GEMM rows
        out, st = jax.lax.map(rows, _query_blocks(q, steps, size))
        out = _from_query_blocks(out, tq, tail=1)
        st = None if st is None else tuple(_from_query_blocks(y, tq, tail=0) for y in st)
    out = jnp.transpose(out.reshape(b, h, tq, hd), (0, 2, 1, 3))
    if not stats:
        return out, None
    entropy, max_logit = (y.reshape(b, h, tq) for y in st)
    return out, (entropy.mean(axis=-1), max_logit.max(axis=-1))


def _query_blocks(q: Array, steps: int, size: int) -> Array:
    """[..., T, hd] -> [steps, ..., size, hd], the query axis zero-padded to steps * size."""
    pad = [(0, 0)] * (q.ndim - 2) + [(0, steps * size - q.shape[-2]), (0, 0)]
    q = jnp.pad(q, pad).reshape(*q.shape[:-2], steps, size, q.shape[-1])
    return jnp.moveaxis(q, -3, 0)


def _from_query_blocks(y: Array, t: int, tail: int) -> Array:
    """[steps, ..., size, *tail axes] -> [..., t, *tail axes] (the padded queries dropped)."""
    y = jnp.moveaxis(y, 0, y.ndim - 2 - tail)
    y = y.reshape(*y.shape[: y.ndim - 2 - tail], -1, *y.shape[y.ndim - tail :])
    return jax.lax.slice_in_dim(y, 0, t, axis=y.ndim - 1 - tail)


class Norm(nn.Module):
    """LayerNorm (centre + scale + bias), LayerNorm without bias (still centres), or RMSNorm."""

    kind: str
    eps: float
    param_dtype: str = "float32"

    @nn.compact
    def __call__(self, x: Array) -> Array:
        x = x.astype(F32)
        if self.kind == "rmsnorm":
            y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
        else:
            mean = jnp.mean(x, axis=-1, keepdims=True)
            var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
            y = (x - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        if self.kind == "layernorm":
            y = y + self.param("bias", nn.initializers.zeros, (x.shape[-1],), self.param_dtype)
        return y


def _norm(cfg: ViTConfig, name: str) -> Norm:
    return Norm(cfg.norm, cfg.norm_eps, cfg.param_dtype, name=name)


def _lecun(fan_in_axes: tuple[int, ...]):
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=fan_in_axes)


_xavier = nn.initializers.xavier_uniform
_zeros = nn.initializers.zeros


# ------------------------------------------------------------------------------------------
# blocks
# ------------------------------------------------------------------------------------------


class ParallelBlock(nn.Module):
    """``y = x + Attn(N(x)) + MLP(N(x))`` with head-grouped fused projections."""

    cfg: ViTConfig
    execution: Execution = AS_WRITTEN

    @nn.compact
    def __call__(self, x: Array, stats: bool, grid: Grid | None = None):
        cfg = self.cfg
        d, h, hd = cfg.width, cfg.heads, cfg.head_dim
        m = cfg.mlp_dim // h  # MLP hidden units per head group
        pdt = cfg.param_dtype
        w_in = self.param("w_in", _lecun((0,)), (d, h, 3 * hd + m), pdt)
        w_out = kernel(self, "w_out", _lecun((0, 1)), (h, hd + m, d))

        y = _norm(cfg, "norm")(x)
        z = dot("btd,dhf->bthf", y, w_in, cfg.compute_dtype)
        q, k, v, u = jnp.split(z, [hd, 2 * hd, 3 * hd], axis=-1)
        if cfg.qkv_bias:
            b_qkv = self.param("b_qkv", _zeros, (h, 3 * hd), pdt).astype(F32)
            q, k, v = q + b_qkv[:, :hd], k + b_qkv[:, hd : 2 * hd], v + b_qkv[:, 2 * hd :]
        if cfg.mlp_bias:
            u = u + self.param("b_mlp", _zeros, (h, m), pdt).astype(F32)
        if cfg.qk_norm:
            q = Norm(cfg.norm, cfg.norm_eps, pdt, name="q_norm")(q)
            k = Norm(cfg.norm, cfg.norm_eps, pdt, name="k_norm")(k)
        q, k = _rope(cfg, grid, q, k)
        o, st = attend(q, k, v, cfg.compute_dtype, stats, self.execution.fold_heads)
        u = activation(u, cfg)
        out = dot_heads(jnp.concatenate([o, u], axis=-1), w_out, cfg.compute_dtype,
                        "w_out" in self.execution.transposed)
        if cfg.out_bias or cfg.mlp_bias:  # attention and MLP out-biases add up into one
            out = out + self.param("b_out", _zeros, (d,), pdt).astype(F32)
        return x + out, st


class SequentialBlock(nn.Module):
    """Pre-norm ``x = x + Attn(N1(x)); x = x + MLP(N2(x))`` (the original ViT)."""

    cfg: ViTConfig
    execution: Execution = AS_WRITTEN

    @nn.compact
    def __call__(self, x: Array, stats: bool, grid: Grid | None = None):
        cfg = self.cfg
        d, h, hd, mlp = cfg.width, cfg.heads, cfg.head_dim, cfg.mlp_dim
        pdt, cdt = cfg.param_dtype, cfg.compute_dtype

        y = _norm(cfg, "norm1")(x)
        qkv = dot("btd,dhf->bthf", y, self.param("w_qkv", _lecun((0,)), (d, h, 3 * hd), pdt), cdt)
        if cfg.qkv_bias:
            qkv = qkv + self.param("b_qkv", _zeros, (h, 3 * hd), pdt).astype(F32)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        if cfg.qk_norm:
            q = Norm(cfg.norm, cfg.norm_eps, pdt, name="q_norm")(q)
            k = Norm(cfg.norm, cfg.norm_eps, pdt, name="k_norm")(k)
        q, k = _rope(cfg, grid, q, k)
        o, st = attend(q, k, v, cdt, stats, self.execution.fold_heads)
        o = dot_heads(o, self.param("w_o", _lecun((0, 1)), (h, hd, d), pdt), cdt)
        if cfg.out_bias:
            o = o + self.param("b_o", _zeros, (d,), pdt).astype(F32)
        x = x + o

        y = _norm(cfg, "norm2")(x)
        hidden = [self._dense(y, "fc1", (d, mlp))]
        if cfg.mlp == "swiglu":
            hidden.append(self._dense(y, "gate", (d, mlp)))
        w_fc2 = kernel(self, "w_fc2", _xavier(), (mlp, d))

        def second(u: Array, gate: Array | None = None) -> Array:  # activation, then fc2
            u = activation(u, cfg) if gate is None else jax.nn.silu(gate) * u
            return dot("btf,fd->btd", u, w_fc2, cdt, "w_fc2" in self.execution.transposed)

        slices = min(self.execution.mlp_slices, y.shape[1])
        if slices > 1:
            pieces = zip(*(jnp.array_split(a, slices, axis=1) for a in hidden))
            y = jnp.concatenate([second(*piece) for piece in pieces], axis=1)
        else:
            y = second(*hidden)
        if cfg.mlp_bias:
            y = y + self.param("b_fc2", _zeros, (d,), pdt).astype(F32)
        return x + y, st

    def _dense(self, y: Array, name: str, shape: tuple[int, int]) -> Array:
        cfg = self.cfg
        kernel = self.param(f"w_{name}", _xavier(), shape, cfg.param_dtype)
        y = dot("btd,df->btf", y, kernel, cfg.compute_dtype)
        if cfg.mlp_bias:
            y = y + self.param(f"b_{name}", _zeros, shape[1:], cfg.param_dtype).astype(F32)
        return y


class MAPHead(nn.Module):
    """Multi-head attention pooling: a learned probe attends over the tokens, then an MLP."""

    cfg: ViTConfig
    execution: Execution = AS_WRITTEN

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.cfg
        d, h, hd, pdt, cdt = cfg.width, cfg.heads, cfg.head_dim, cfg.param_dtype, cfg.compute_dtype
        probe = self.param("probe", _xavier(), (1, 1, d), pdt).astype(F32)
        probe = jnp.broadcast_to(probe, (x.shape[0], 1, d))
        q = dot("btd,dhf->bthf", probe, self.param("w_q", _xavier(), (d, h, hd), pdt), cdt)
        kv = dot("btd,dhf->bthf", x, self.param("w_kv", _xavier(), (d, h, 2 * hd), pdt), cdt)
        q = q + self.param("b_q", _zeros, (h, hd), pdt).astype(F32)
        kv = kv + self.param("b_kv", _zeros, (h, 2 * hd), pdt).astype(F32)
        k, v = jnp.split(kv, 2, axis=-1)
        o, _ = attend(q, k, v, cdt, False, self.execution.fold_heads)
        y = dot_heads(o, self.param("w_o", _xavier(), (h, hd, d), pdt), cdt)
        y = y + self.param("b_o", _zeros, (d,), pdt).astype(F32)
        z = _norm(cfg, "norm")(y)
        z = dot("btd,df->btf", z, self.param("w_fc1", _xavier(), (d, cfg.map_mlp_dim), pdt), cdt)
        # the blocks' nonlinearity: timm's and transformers' pooling heads take the model's
        z = activation(z + self.param("b_fc1", _zeros, (cfg.map_mlp_dim,), pdt).astype(F32), cfg)
        w_fc2 = kernel(self, "w_fc2", _xavier(), (cfg.map_mlp_dim, d))
        z = dot("btf,fd->btd", z, w_fc2, cdt, "w_fc2" in self.execution.transposed)
        z = z + self.param("b_fc2", _zeros, (d,), pdt).astype(F32)
        return (y + z)[:, 0]


# ------------------------------------------------------------------------------------------
# the backbone
# ------------------------------------------------------------------------------------------


class ViT(nn.Module):
    """Images [B, H, W, C] (already normalised; H and W multiples of the patch) -> dict of the
    requested outputs, at the images' grid (rows, cols) = (H / patch, W / patch).

    Keys: ``pooled`` [B, d] ([B, projection_dim] with a projection); ``pre_projection`` [B, d];
    ``class_token`` [B, d]; ``register_tokens`` [B, R, d]; ``patch_tokens`` {layer: [B, N, d]}
    (N = rows * cols, row-major); ``attention_entropy`` and ``attention_max_logit``
    [B, depth, heads]; ``logits`` [B, classes].

    ``pos``: the learned position table at the images' grid ([1, prefix rows + N, d],
    ``position_table``); without it the stored table is used, which must be at that grid.
    """

    cfg: ViTConfig
    execution: Execution = AS_WRITTEN

    @nn.compact
    def __call__(
        self, images: Array, request: OutputRequest = POOLED, pos: Array | None = None
    ) -> dict:
        cfg = self.cfg
        pdt, cdt = cfg.param_dtype, cfg.compute_dtype
        b, p = images.shape[0], cfg.patch
        if images.ndim != 4 or images.shape[3] != cfg.channels:
            raise ValueError(
                f"images of shape {images.shape[1:]} are not [height, width, {cfg.channels}]"
            )
        grid = rows, cols = cfg.grid_at(images.shape[1], images.shape[2])
        # Patchify as a matmul (faster than a conv on CPU); flattening order (ph, pw, c) is the
        # HWIO conv kernel's, so conv weights reshape into it directly.
        x = images.reshape(b, rows, p, cols, p, cfg.channels).transpose(0, 1, 3, 2, 4, 5)
        x = x.reshape(b, rows * cols, p * p * cfg.channels)
        kernel = self.param("patch_embed", _lecun((0,)), (p * p * cfg.channels, cfg.width), pdt)
        x = dot("bnk,kd->bnd", x, kernel, cdt)
        if cfg.patch_bias:
            x = x + self.param("patch_bias", _zeros, (cfg.width,), pdt).astype(F32)

        x = self._embed_positions(x, grid, pos)
        if cfg.pre_norm:
            x = _norm(cfg, "pre_norm")(x)

        layers = request.layers(cfg.depth)
        needs_head = (
            request.pooled
            or request.class_token
            or request.register_tokens
            or request.pre_projection
            or request.logits
        )
        # Stop after the deepest requested layer when nothing further down is needed.
        last = cfg.depth - 1 if (needs_head or request.attention_stats) else max(layers, default=-1)
        block_cls = ParallelBlock if cfg.block == "parallel" else SequentialBlock
        encoder_norm = _norm(cfg, "encoder_norm")
        n_cls, n_prefix = int(cfg.class_token), cfg.num_prefix_tokens

        out: dict = {}
        patches, entropies, max_logits = {}, [], []
        for i in range(last + 1):
            block = block_cls(cfg, self.execution, name=f"block_{i}")
            x, st = block(x, request.attention_stats, grid)
            if st is not None:
                entropies.append(st[0])
                max_logits.append(st[1])
            if i in layers:
                tokens = encoder_norm(x) if request.norm_patches and not cfg.pool_norm else x
                patches[i] = tokens[:, n_prefix:]
        if patches:
            out["patch_tokens"] = patches
        if request.attention_stats:
            out["attention_entropy"] = jnp.stack(entropies, axis=1)
            out["attention_max_logit"] = jnp.stack(max_logits, axis=1)
        if not needs_head:
            return out

        if not cfg.pool_norm:
            x = encoder_norm(x)
        if request.class_token:
            if not cfg.class_token:
                raise ValueError(f"model {cfg.name} has no class token")
            out["class_token"] = x[:, 0]
        if request.register_tokens:
            if not cfg.num_registers:
                raise ValueError(f"model {cfg.name} has no register tokens")
            out["register_tokens"] = x[:, n_cls:n_prefix]
        if request.pooled or request.pre_projection or request.logits:
            if cfg.head == "none":
                raise ValueError(f"model {cfg.name} has no pooling head (head='none')")
            if cfg.head == "map":
                pooled = MAPHead(cfg, self.execution, name="map_head")(x[:, n_prefix:])
            elif cfg.head == "cls":
                pooled = x[:, 0]
            elif cfg.head == "prefix":  # timm's distilled DeiT: (CLS + distillation) / 2
                pooled = x[:, :n_prefix].mean(axis=1)
            else:
                pooled = x[:, n_prefix:].mean(axis=1)
            if cfg.pool_norm:
                pooled = encoder_norm(pooled)
            if request.pre_projection:
                if not cfg.projection_dim:
                    raise ValueError(f"model {cfg.name} has no projection (projection_dim=0)")
                out["pre_projection"] = pooled
            if request.pooled:
                out["pooled"] = pooled
                if cfg.projection_dim:
                    shape = (cfg.width, cfg.projection_dim)
                    w = self.param("projection", _xavier(), shape, pdt)
                    out["pooled"] = dot("bd,dp->bp", pooled, w, cdt)
            if request.logits:  # the classifier reads the pooled feature before any projection
                if not cfg.num_classes:
                    raise ValueError(f"model {cfg.name} has no classifier (num_classes=0)")
                w = self.param("classifier", _zeros, (cfg.width, cfg.num_classes), pdt)
                bias = self.param("classifier_bias", _zeros, (cfg.num_classes,), pdt)
                out["logits"] = dot("bd,dc->bc", pooled, w, cdt) + bias.astype(F32)
        return out

    def _embed_positions(self, x: Array, grid: Grid, pos: Array | None) -> Array:
        """Embedded patches [B, N, d] -> tokens [B, T, d]: class token, registers, patches, with
        the position table added (rope: none here; it rotates queries and keys in the blocks)."""
        cfg = self.cfg
        b, d, pdt = x.shape[0], cfg.width, cfg.param_dtype
        if cfg.posemb == "learn":
            n_pos = cfg.table_rows(cfg.table_grid)
            table = self.param("pos_embedding", nn.initializers.normal(0.02), (1, n_pos, d), pdt)
            if pos is None:
                if grid != cfg.table_grid:
                    raise ValueError(
                        f"the position table is for a {cfg.table_grid} grid, the images give "
                        f"{grid}: pass pos=position_table(cfg, params, grid)"
                    )
                pos = table
            if pos.shape != (1, cfg.table_rows(grid), d):
                raise ValueError(f"pos of shape {pos.shape} is not the table for grid {grid}")
            pos = pos.astype(F32)
        elif cfg.posemb == "sincos2d":
            pos = jnp.asarray(sincos2d(*grid, d))[None]
        else:  # rope
            pos = 0.0
        prefix = []  # the class token, then the registers
        if cfg.class_token:
            cls = self.param("cls", _zeros, (1, 1, d), pdt).astype(F32)
            prefix.append(jnp.broadcast_to(cls, (b, 1, d)))
        if cfg.num_registers:
            shape = (1, cfg.num_registers, d)
            reg = self.param("registers", nn.initializers.normal(0.02), shape, pdt).astype(F32)
            prefix.append(jnp.broadcast_to(reg, (b, *shape[1:])))
        if cfg.posemb_covers_registers:  # a table row for every prefix token
            return jnp.concatenate([*prefix, x], axis=1) + pos
        if cfg.class_token and cfg.posemb_covers_cls:
            x = jnp.concatenate([prefix[0], x], axis=1) + pos
            return jnp.concatenate([x[:, :1], *prefix[1:], x[:, 1:]], axis=1)
        return jnp.concatenate([*prefix, x + pos], axis=1)


def position_table(cfg: ViTConfig, params: dict, grid: Grid) -> Array | None:
    """The learned table at ``grid`` [1, prefix rows + N, d], resampled as its source does
    (``cfg.posemb_resample``, model/posemb.py): in float32, cast back to the parameter dtype
    (timm and DINOv2 do the same); the prefix tokens' rows untouched. None for sin-cos and RoPE
    (computed for the grid inside the forward). The stored table itself at its own grid.

    Works on concrete arrays (the engine calls it once per grid) and inside a trace."""
    if cfg.posemb != "learn":
        return None
    table = params["pos_embedding"]
    old = cfg.table_grid
    if tuple(grid) == old:
        return table
    if cfg.posemb_resample == "none":
        raise ValueError(
            f"{cfg.name}: its position table is for a {old[0]}x{old[1]} grid only "
            f"(posemb_resample='none'); a {grid[0]}x{grid[1]} grid was asked for"
        )
    n_prefix, d = cfg.posemb_prefix_rows, cfg.width
    patches = table[0, n_prefix:].astype(F32).reshape(*old, d)
    wy, wx = (resample_weights(o, n, cfg.posemb_resample) for o, n in zip(old, grid))
    hi = jax.lax.Precision.HIGHEST
    patches = jnp.einsum("xj,ijd->ixd", wx, patches, precision=hi)  # torch: the width pass,
    patches = jnp.einsum("yi,ixd->yxd", wy, patches, precision=hi)  # then the height pass
    patches = patches.reshape(1, grid[0] * grid[1], d).astype(table.dtype)
    return jnp.concatenate([table[:, :n_prefix], patches], axis=1)


@functools.partial(jax.jit, static_argnums=0)
def init_params(cfg: ViTConfig, rng: Array) -> dict:
    """All parameters of the model (every head the config has); the position table at its own
    grid (``cfg.table_grid``). Compiled whole: run op by op, the forward that Flax's init goes
    through compiles each of its operations alone (over 4x the time for a tiny model on XLA:CPU,
    benchmarks/compile_cost.py)."""
    side = cfg.table_grid[0] * cfg.patch
    dummy = jnp.zeros((1, side, side, cfg.channels), F32)
    return ViT(cfg).init(rng, dummy, _init_request(cfg))["params"]


def _init_request(cfg: ViTConfig) -> OutputRequest:
    return OutputRequest(
        pooled=cfg.head != "none",
        class_token=cfg.class_token,
        register_tokens=cfg.num_registers > 0,
        logits=cfg.num_classes > 0,
        patch_layers=(cfg.depth - 1,),
        norm_patches=True,
    )


def abstract_params(cfg: ViTConfig) -> dict:
    """Parameter shapes and dtypes without allocating anything (works for 22B on a laptop)."""
    return jax.eval_shape(lambda key: init_params(cfg, key), jax.random.key(0))


def apply(
    cfg: ViTConfig,
    params: dict,
    images: Array,
    request: OutputRequest,
    pos: Array | None = None,
    execution: Execution = AS_WRITTEN,
) -> dict:
    """The forward at the images' grid; ``pos``: ``position_table`` at that grid, computed here
    when not given (the engine passes the one it computed once for the grid); ``execution``:
    how it runs on this host (the engine's plan)."""
    if pos is None:
        pos = position_table(cfg, params, cfg.grid_at(images.shape[1], images.shape[2]))
    return ViT(cfg, execution).apply({"params": params}, images, request, pos)
