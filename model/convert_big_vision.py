"""big_vision: the parameter names of its models/vit.py in .npz files (flat '/'-joined keys), alone
or as the image tower (``params/img/``) of a two-tower SigLIP checkpoint, MAPHead included; and
the older google-research/vision_transformer layout (the original ViT and AugReg .npz files),
whose blocks number their modules otherwise and whose position table covers the class token."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from .config import ViTConfig
from .convert_common import (
    ConvertError,
    Hints,
    Sizes,
    SourceTensors,
    count_blocks,
    grid_of,
    norm_params,
    patch_conv,
)
from .convert_preprocess import SourcePreprocess

_BV_PREFIXES = ("params/img/", "opt/target/", "params/")
# the other tower of big_vision's two_towers (SigLIP), its temperature t and bias b
_SIGLIP_TEXT = re.compile(r"^params/(txt/.*|t|b)$")
# vision_transformer's names within a block -> big_vision's (as timm's _load_weights pairs them)
_VIT_JAX_BLOCK = (("MultiHeadDotProductAttention_1/", "MultiHeadDotProductAttention_0/"),
                  ("LayerNorm_2/", "LayerNorm_1/"), ("MlpBlock_3/", "MlpBlock_0/"))
VIT_JAX_POSEMB = "Transformer/posembed_input/pos_embedding"  # kept: it says the layout


SIDE_FILES: tuple[str, ...] = ()


def side_files(path: Path) -> dict:
    """None: big_vision keeps config and preprocessing in its training config, not the npz."""
    return {}


def preprocessing(side: dict, image_size: int) -> SourcePreprocess:
    """big_vision's usual value_range(-1, 1) and a plain resize to the model's size."""
    half = (0.5, 0.5, 0.5)
    where = "big_vision defaults (the .npz does not say)"
    return SourcePreprocess(where, False, image_size, image_size, "bilinear", half, half)


def canonical(tensors: dict[str, np.ndarray], notes: list[str]) -> dict[str, np.ndarray]:
    """Strip the tree prefix and unstack scanned blocks into encoderblock_{i}."""
    for prefix in _BV_PREFIXES:
        if f"{prefix}embedding/kernel" in tensors:
            text = [k for k in tensors if prefix == "params/img/" and _SIGLIP_TEXT.match(k)]
            if text:  # a SigLIP / two-tower checkpoint: the image tower is served
                notes.append(f"dropped the text tower and its scalars ({len(text)} tensors)")
                tensors = {k: v for k, v in tensors.items() if k not in set(text)}
            other = sorted(k for k in tensors if not k.startswith(prefix))
            if other:
                groups = sorted({"/".join(k.split("/")[:2]) for k in other})
                raise ConvertError(
                    f"big_vision checkpoint: keys outside the image tower {prefix!r}: {groups}; "
                    "extract the image tower first"
                )
            tensors = {k.removeprefix(prefix): v for k, v in tensors.items()}
            break
    if "Transformer/encoderblock_0/MultiHeadDotProductAttention_1/query/kernel" in tensors:
        renamed = {_from_vit_jax(k): k for k in tensors}
        if len(renamed) < len(tensors):  # both names of a pair: which the block uses is unclear
            both = sorted(k for k in tensors if _from_vit_jax(k) != k
                          and _from_vit_jax(k) in tensors)
            raise ConvertError(f"big_vision checkpoint: vision_transformer's layout, but "
                               f"{both[0]!r} beside {_from_vit_jax(both[0])!r}, big_vision's "
                               "name for it: which the block uses is unclear")
        tensors = {new: tensors[old] for new, old in renamed.items()}
        notes.append("google-research/vision_transformer's layout (the original ViT and AugReg "
                     "files): its blocks' modules renamed as big_vision numbers them")
    scanned = "Transformer/encoderblock/"
    if not any(k.startswith(scanned) for k in tensors):
        return tensors
    out = {k: v for k, v in tensors.items() if not k.startswith(scanned)}
    for key, value in tensors.items():
        if key.startswith(scanned):
            for i in range(value.shape[0]):
                out[f"Transformer/encoderblock_{i}/{key.removeprefix(scanned)}"] = value[i]
    notes.append("unstacked scanned encoder blocks (Transformer/encoderblock)")
    return out


def _from_vit_jax(key: str) -> str:
    head, sep, rest = key.partition("/encoderblock_")
    if not sep:
        return key
    index, _, name = rest.partition("/")
    for old, new in _VIT_JAX_BLOCK:
        if name.startswith(old):
            name = new + name.removeprefix(old)
    return f"{head}{sep}{index}/{name}"


def _posemb_key(t: SourceTensors) -> str | None:
    return next((key for key in ("pos_embedding", VIT_JAX_POSEMB) if key in t), None)


def infer_config(t: SourceTensors, hints: Hints, side: dict) -> ViTConfig:
    t.refuse("pre_logits/kernel", "a representation (pre-logits) layer")
    width, channels, patch = patch_conv(t, "embedding/kernel", hwio=True)
    depth = count_blocks(t, r"Transformer/encoderblock_(\d+)/")
    a = "Transformer/encoderblock_0/MultiHeadDotProductAttention_0/"
    _, heads, _ = t.shape(a + "query/kernel")
    class_token = "cls" in t
    posemb, covers_cls = _posemb_key(t), False
    if posemb is not None:  # vision_transformer adds its table after the class token joins
        vit_jax = posemb == VIT_JAX_POSEMB
        grid, covers_cls = grid_of(t.shape(posemb)[1], class_token and vit_jax, t.source)
        if vit_jax and class_token and not covers_cls:  # its code adds the table after the token
            raise ConvertError(f"big_vision checkpoint: vision_transformer's layout with a class "
                               f"token, but its position table of {t.shape(posemb)[1]} rows has "
                               "none for it (that code could not run this file)")
    else:
        if hints.preset is None:
            raise ConvertError(
                "big_vision checkpoint without pos_embedding (fixed sine-cosine position "
                "embedding): the image size is not in the weights; pass --model PRESET"
            )
        grid = hints.preset.grid
    head = "map" if "MAPHead_0/probe" in t else "cls" if class_token else "gap"
    if head == "gap":  # big_vision's pool_type is code: '0' and 'none' leave the same weights
        t.notes.append("no class token and no MAPHead: pooled output read as the average of the "
                       "patch tokens (big_vision pool_type 'gap'; '0' would take the first token)")
    mlp_dim = t.shape("Transformer/encoderblock_0/MlpBlock_0/Dense_0/kernel")[1]
    head_mlp = t.shape("MAPHead_0/MlpBlock_0/Dense_0/kernel")[1] if head == "map" else None
    sizes = Sizes(width, depth, heads, mlp_dim, patch, grid, channels, head_mlp)
    return sizes.config(
        block="sequential",
        norm="layernorm",
        norm_eps=1e-6,
        qkv_bias=a + "query/bias" in t,
        out_bias=a + "out/bias" in t,
        mlp_bias=True,
        qk_norm=False,
        head=head,
        class_token=class_token,
        posemb="learn" if posemb else "sincos2d",
        posemb_covers_cls=covers_cls,  # big_vision adds it to the patches, then the token
        gelu_exact=False,  # flax's nn.gelu is the tanh approximation
        num_classes=t.shape("head/kernel")[1] if "head/kernel" in t else 0,
    )


def _bv_attention(t: SourceTensors, prefix: str, cfg: ViTConfig, names: tuple[str, ...]):
    """Flax MultiHeadDotProductAttention: kernels [d, H, hd] fused per head in ``names`` order."""
    d, h, hd = cfg.width, cfg.heads, cfg.head_dim
    kernel = np.concatenate([t.take(f"{prefix}{n}/kernel", (d, h, hd)) for n in names], -1)
    bias = np.concatenate([t.take(f"{prefix}{n}/bias", (h, hd)) for n in names], -1)
    return (
        kernel,
        bias,
        t.take(f"{prefix}out/kernel", (h, hd, d)),
        t.take(f"{prefix}out/bias", (d,)),
    )


def _bv_mlp(t: SourceTensors, prefix: str, d: int, mlp: int) -> dict:
    return {
        "w_fc1": t.take(prefix + "Dense_0/kernel", (d, mlp)),
        "b_fc1": t.take(prefix + "Dense_0/bias", (mlp,)),
        "w_fc2": t.take(prefix + "Dense_1/kernel", (mlp, d)),
        "b_fc2": t.take(prefix + "Dense_1/bias", (d,)),
    }


def _bv_norm(t: SourceTensors, prefix: str, cfg: ViTConfig) -> dict:
    return norm_params(t, prefix + "scale", prefix + "bias", cfg, cfg.width)


def build_params(t: SourceTensors, cfg: ViTConfig) -> dict:
    d, c, p, h, hd = cfg.width, cfg.channels, cfg.patch, cfg.heads, cfg.head_dim
    params = {
        "patch_embed": t.take("embedding/kernel", (p, p, c, d)).reshape(-1, d),
        "patch_bias": t.take("embedding/bias", (d,)),
        "encoder_norm": _bv_norm(t, "Transformer/encoder_norm/", cfg),
    }
    if cfg.posemb == "learn":
        params["pos_embedding"] = t.take(_posemb_key(t) or "pos_embedding",
                                         (1, cfg.table_rows(cfg.table_grid), d))
    if cfg.class_token:
        params["cls"] = t.take("cls", (1, 1, d))
    for i in range(cfg.depth):
        b = f"Transformer/encoderblock_{i}/"
        if not cfg.qkv_bias or not cfg.out_bias:
            raise ConvertError(f"big_vision checkpoint: {b} attention without biases")
        w_qkv, b_qkv, w_o, b_o = _bv_attention(
            t, b + "MultiHeadDotProductAttention_0/", cfg, ("query", "key", "value")
        )
        params[f"block_{i}"] = {
            "norm1": _bv_norm(t, b + "LayerNorm_0/", cfg),
            "norm2": _bv_norm(t, b + "LayerNorm_1/", cfg),
            "w_qkv": w_qkv,
            "b_qkv": b_qkv,
            "w_o": w_o,
            "b_o": b_o,
            **_bv_mlp(t, b + "MlpBlock_0/", d, cfg.mlp_dim),
        }
    if cfg.head == "map":
        w_kv, b_kv, w_o, b_o = _bv_attention(
            t, "MAPHead_0/MultiHeadDotProductAttention_0/", cfg, ("key", "value")
        )
        q = "MAPHead_0/MultiHeadDotProductAttention_0/query/"
        params["map_head"] = {
            "probe": t.take("MAPHead_0/probe", (1, 1, d)),
            "w_q": t.take(q + "kernel", (d, h, hd)),
            "b_q": t.take(q + "bias", (h, hd)),
            "w_kv": w_kv,
            "b_kv": b_kv,
            "w_o": w_o,
            "b_o": b_o,
            "norm": _bv_norm(t, "MAPHead_0/LayerNorm_0/", cfg),
            **_bv_mlp(t, "MAPHead_0/MlpBlock_0/", d, cfg.map_mlp_dim),
        }
    if cfg.num_classes:
        params["classifier"] = t.take("head/kernel", (d, cfg.num_classes))
        params["classifier_bias"] = t.take("head/bias", (cfg.num_classes,))
    return params
