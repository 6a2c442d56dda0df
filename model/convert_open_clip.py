"""OpenCLIP: the image tower of a CLIP state dict (``visual.*``; the text tower is dropped) or of
a bare ``VisionTransformer``, with the ``open_clip_config.json`` the hub keeps beside it.

The activation is code, not weights: the config's ``quick_gelu`` (OpenAI's checkpoints) decides,
or ``--mlp``; neither refuses. Pooling is the class token after ``ln_post``, then ``proj``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .config import ViTConfig
from .convert_common import (
    ConvertError,
    Hints,
    Sizes,
    SourceTensors,
    check_claims,
    count_blocks,
    fold_layer_scale,
    fused_bias_to_heads,
    fused_to_heads,
    grid_of,
    infer_heads,
    patch_conv,
    patch_kernel,
    split_heads_out,
    torch_linear,
    torch_norm,
)
from .convert_preprocess import SourcePreprocess, unservable
from .convert_side import OPEN_CLIP_CONFIG, OPEN_CLIP_MODEL, read_side

WEIGHT_FILES = (
    "open_clip_model.safetensors",
    "open_clip_pytorch_model.safetensors",
    "open_clip_pytorch_model.bin",
    "open_clip_pytorch_model.pth",
)
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)  # open_clip.constants
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
_BLOCK = "transformer.resblocks.{i}."


SIDE_FILES = ("open_clip_config.json",)


def side_files(path: Path) -> dict:
    """open_clip_config.json: model_cfg (vision_cfg, quick_gelu) and preprocess_cfg. A file in
    the layout of open_clip's own ``model_configs/*.json`` (those keys at the top, no model_cfg:
    what ``open_clip.get_model_config`` reads) is read as its model_cfg, not as no file."""
    side = read_side(path, "open_clip_config.json", OPEN_CLIP_CONFIG)
    top = {key: side.pop(key) for key in OPEN_CLIP_MODEL if key in side}
    if top and "model_cfg" in side:
        raise ConvertError(f"open_clip_config.json beside {path} has both a model_cfg and "
                           f"{', '.join(sorted(top))} outside it: which describes the model is "
                           "unclear; keep one")
    if top:
        side["model_cfg"] = top
    return side


def canonical(tensors: dict[str, np.ndarray], notes: list[str]) -> dict[str, np.ndarray]:
    if not any(key.startswith("visual.") for key in tensors):
        if "conv1.weight" not in tensors:
            text = "token_embedding.weight" in tensors
            held = "a text tower only (token_embedding.weight, ...)" if text else "no image tower"
            raise ConvertError(
                f"open_clip checkpoint: {held}: no visual.* keys nor a bare tower's conv1.weight; "
                f"its keys begin: {', '.join(sorted(tensors)[:8]) or 'none'}"
            )
        return tensors  # a bare vision tower
    other = [key for key in tensors if not key.startswith("visual.")]
    if other:
        notes.append(f"dropped the text tower and logit scale ({len(other)} tensors)")
    return {k.removeprefix("visual."): v for k, v in tensors.items() if k.startswith("visual.")}


def infer_config(t: SourceTensors, hints: Hints, side: dict) -> ViTConfig:
    for key, what in (
        ("attn_pool.query", "an attentional pooler (CoCa)"),
        ("transformer.resblocks.0.attn.ln_inner.weight",
         "a norm inside attention (scale_attn_inner)"),
        ("transformer.resblocks.0.mlp.ln.weight", "a norm inside the MLP (scale_fc)"),
        ("transformer.resblocks.0.ln_attn.weight", "a norm after attention (scale_attn)"),
        ("transformer.resblocks.0.attn.head_scale", "a learned scale per head (scale_heads)"),
        ("transformer.resblocks.0.attn.ln_q.weight", "QK-norm (qk_norm)"),
        ("transformer.resblocks.0.attn.logit_scale", "cosine attention with a learned "
         "temperature (scaled_cosine_attn)"),
    ):
        t.refuse(key, what)
    if any(key.startswith("trunk.") for key in t.tensors):
        raise ConvertError(
            "open_clip checkpoint: an image tower built on a timm model (vision_cfg."
            "timm_model_name, keys 'trunk.*') is not supported; only open_clip's own "
            "VisionTransformer is"
        )
    model_cfg = side.get("model_cfg") or {}
    vision = model_cfg.get("vision_cfg") or {}
    if vision.get("pool_type", "tok") != "tok" or vision.get("attentional_pool"):
        raise ConvertError(
            f"open_clip checkpoint: vision_cfg pool_type={vision.get('pool_type')!r} / "
            f"attentional_pool={vision.get('attentional_pool')!r}: only class-token pooling "
            "('tok') is supported"
        )
    if not vision:  # a bare tower: what is code, not weights, is assumed and said
        t.notes.append("no vision_cfg (no open_clip_config.json, or none in it): pooling read "
                       "as the class token (pool_type "
                       "'tok'), LayerNorm epsilon 1e-5 and the exact GELU (norm_kwargs and "
                       "act_kwargs unset)")
    width, channels, patch = patch_conv(t, "conv1.weight")
    depth = count_blocks(t, r"transformer\.resblocks\.(\d+)\.")
    grid, covers_cls = grid_of(t.shape("positional_embedding")[0], True, t.source)
    heads = infer_heads(t, hints, None, width, _heads_from(vision, width))
    if "quick_gelu" in model_cfg:
        mlp = "quick_gelu" if model_cfg["quick_gelu"] else "gelu"
        if hints.mlp and hints.mlp != mlp:
            raise ConvertError(
                f"open_clip checkpoint: --mlp {hints.mlp} contradicts open_clip_config.json's "
                f"quick_gelu={model_cfg['quick_gelu']}"
            )
    elif hints.mlp:
        mlp = hints.mlp
    else:
        raise ConvertError(
            "open_clip checkpoint: the weights do not say whether the MLP is GELU or QuickGELU "
            "(OpenAI's), and no open_clip_config.json beside them gives quick_gelu: put its "
            "config there or pass --mlp gelu|quick_gelu"
        )
    norm_eps, gelu_exact = _kwargs(vision, mlp)
    if vision.get("final_ln_after_pool"):  # ln_post on the pooled token alone: the same pooled
        t.notes.append("final_ln_after_pool: open_clip's own patch tokens are before ln_post "
                       "(ask for them with normalize_patches off)")
    b = _BLOCK.format(i=0)
    sizes = Sizes(width, depth, heads, t.shape(b + "mlp.c_fc.weight")[0], patch, grid, channels)
    cfg = sizes.config(
        patch_bias=False,  # open_clip's conv1 has none
        block="sequential",
        norm="layernorm",
        norm_eps=norm_eps,
        gelu_exact=gelu_exact,
        qkv_bias=b + "attn.in_proj_bias" in t,
        out_bias=True,
        mlp_bias=True,
        qk_norm=False,
        head="cls",
        class_token=True,
        posemb_covers_cls=covers_cls,
        pre_norm="ln_pre.weight" in t,
        mlp=mlp,
        projection_dim=t.shape("proj")[1] if "proj" in t else 0,
    )
    _check_side(model_cfg, cfg)
    return cfg


def _kwargs(vision: dict, mlp: str) -> tuple[float, bool]:
    """(norm eps, exact GELU) from vision_cfg's norm_kwargs and act_kwargs: torch's LayerNorm
    eps (1e-5) and nn.GELU's exact form where they are silent; any other argument is refused."""
    norm = dict(vision.get("norm_kwargs") or {})
    act = dict(vision.get("act_kwargs") or {})
    eps = float(norm.pop("eps", 1e-5))
    approximate = act.pop("approximate", "none") if mlp == "gelu" else "none"
    if norm or act or approximate not in ("none", "tanh"):
        unknown = {**{f"norm_kwargs.{k}": v for k, v in norm.items()},
                   **{f"act_kwargs.{k}": v for k, v in act.items()}}
        if approximate not in ("none", "tanh"):
            unknown["act_kwargs.approximate"] = approximate
        raise ConvertError(f"open_clip checkpoint: vision_cfg {unknown} is not supported")
    return eps, approximate == "none"


def _check_side(model_cfg: dict, cfg: ViTConfig) -> None:
    """open_clip_config.json's vision_cfg sizes and embed_dim, where it gives them, must be the
    weights'."""
    vision = model_cfg.get("vision_cfg") or {}
    size = vision.get("image_size")
    if isinstance(size, (list, tuple)):
        if len(size) != 2 or size[0] != size[1]:
            raise ConvertError(f"open_clip checkpoint: vision_cfg.image_size={size!r}, a "
                               "non-square input: only square patch grids are supported")
        size = size[0]
    if size and size % cfg.patch:  # open_clip's conv drops the rest: its crop is not the grid's
        raise ConvertError(f"open_clip checkpoint: vision_cfg.image_size={size} is not a whole "
                           f"number of {cfg.patch}-pixel patches (open_clip's patch embedding "
                           f"drops the last {size % cfg.patch} pixels of its crop), which is not "
                           "supported")
    ratio = vision.get("mlp_ratio")
    head_width = vision.get("head_width")
    claims = {
        "vision_cfg.width": (vision.get("width"), cfg.width),
        "vision_cfg.layers": (vision.get("layers"), cfg.depth),
        "vision_cfg.patch_size": (vision.get("patch_size"), cfg.patch),
        "vision_cfg.image_size": (size, cfg.image_size),
        # open_clip floors the head count: width // head_width heads of width // heads
        "heads (vision_cfg.width // head_width)": (
            head_width and cfg.width // head_width, cfg.heads),
        "the MLP width (vision_cfg.mlp_ratio x width)": (
            ratio and int(ratio * vision.get("width", cfg.width)),
            cfg.mlp_dim,
        ),
        "embed_dim": (model_cfg.get("embed_dim"), cfg.projection_dim or None),
    }
    check_claims("open_clip", "open_clip_config.json", claims)


def _heads_from(vision: dict, width: int) -> int | None:
    """open_clip's vision_cfg names head_width (default 64), not the head count."""
    if not vision:
        return None
    return width // int(vision.get("head_width", 64))


def preprocessing(side: dict, image_size: int) -> SourcePreprocess:
    """open_clip's PreprocessCfg: resize_mode 'shortest' (the default) resizes the shorter side
    to the input size and centre-crops; bicubic and OpenAI's mean/std where it is silent."""
    cfg = side.get("preprocess_cfg") or {}
    where = "open_clip_config.json preprocess_cfg"
    if not cfg:
        where = "open_clip defaults (no preprocess_cfg in open_clip_config.json)"
    size = cfg.get("size", image_size)
    if isinstance(size, (list, tuple)):
        if len(set(size)) != 1:
            raise ConvertError(f"open_clip {where}: size {size} is not square")
        size = size[0]
    mode = cfg.get("resize_mode", "shortest")
    kinds = {"shortest": "shortest", "squash": "squash", "longest": "longest"}
    geometry = None if mode == "squash" else unservable("resize_mode", mode, size, kinds)
    return SourcePreprocess(
        where,
        bool(cfg),
        resize=int(size),
        crop=int(size),
        interpolation=cfg.get("interpolation", "bicubic"),
        mean=tuple(cfg.get("mean", OPENAI_MEAN)),
        std=tuple(cfg.get("std", OPENAI_STD)),
        geometry=geometry,
        squash=mode == "squash",
    )


def _block(t: SourceTensors, b: str, cfg: ViTConfig) -> dict:
    d, h, m = cfg.width, cfg.heads, cfg.mlp_dim
    w_in = t.take(b + "attn.in_proj_weight", (3 * d, d)).T  # nn.MultiheadAttention: q|k|v
    block = {
        "norm1": torch_norm(t, b + "ln_1", cfg),
        "norm2": torch_norm(t, b + "ln_2", cfg),
        "w_qkv": fused_to_heads(w_in, 3, h),
    }
    if cfg.qkv_bias:
        block["b_qkv"] = fused_bias_to_heads(t.take(b + "attn.in_proj_bias", (3 * d,)), 3, h)
    w_o, b_o = torch_linear(t, b + "attn.out_proj", d, d, True)
    block["w_fc1"], block["b_fc1"] = torch_linear(t, b + "mlp.c_fc", m, d, True)
    w_fc2, b_fc2 = torch_linear(t, b + "mlp.c_proj", d, m, True)
    fold_layer_scale(t, b + "ls_1.gamma", d, w_o, b_o)
    fold_layer_scale(t, b + "ls_2.gamma", d, w_fc2, b_fc2)
    block.update(w_o=split_heads_out(w_o, h), b_o=b_o, w_fc2=w_fc2, b_fc2=b_fc2)
    return block


def build_params(t: SourceTensors, cfg: ViTConfig) -> dict:
    d, c, p = cfg.width, cfg.channels, cfg.patch
    params = {
        "patch_embed": patch_kernel(t.take("conv1.weight", (d, c, p, p))),
        "cls": t.take("class_embedding", (d,)).reshape(1, 1, d),
        "pos_embedding": t.take("positional_embedding", (math.prod(cfg.table_grid) + 1, d))[None],
        "encoder_norm": torch_norm(t, "ln_post", cfg),
    }
    if cfg.pre_norm:
        params["pre_norm"] = torch_norm(t, "ln_pre", cfg)
    for i in range(cfg.depth):
        params[f"block_{i}"] = _block(t, _BLOCK.format(i=i), cfg)
    if cfg.projection_dim:
        params["projection"] = t.take("proj", (d, cfg.projection_dim))  # x @ proj: (in, out)
    return params
