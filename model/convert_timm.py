"""timm: VisionTransformer with Block (vit_*, DINOv2 with LayerScale, registers and SwiGLUPacked,
CLIP, SigLIP) or ParallelScalingBlock (*_xp_*), attention pooling.

timm's parallel block fuses its input projection as mlp|q|k|v; it is regrouped per head into
``w_in: [d, H, 3*hd + M/H]`` (q|k|v|mlp slice), the layout vit.py shards over heads.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from . import convert_timm_dinov3
from .config import IMAGENET_PREPROCESS, ViTConfig
from .convert_common import (
    ConvertError,
    Hints,
    Sizes,
    SourceTensors,
    arg_name,
    check_claims,
    count_blocks,
    fold_layer_scale,
    fused_bias_to_heads,
    fused_to_heads,
    grid_of,
    infer_heads,
    patch_conv,
    patch_kernel,
    split_heads_in,
    split_heads_out,
    torch_linear,
    torch_norm,
)
from .convert_preprocess import SourcePreprocess, unservable
from .convert_side import TIMM_CONFIG, read_side

IMAGENET_MEAN, IMAGENET_STD = IMAGENET_PREPROCESS.mean, IMAGENET_PREPROCESS.std


SIDE_FILES = ("config.json",)


def side_files(path: Path) -> dict:
    """timm's hub config.json (architecture, num_classes, global_pool, model_args,
    pretrained_cfg); its model_args over what the architecture passes itself (``_own_args``)."""
    side = read_side(path, "config.json", TIMM_CONFIG)
    own = _own_args(side.get("architecture", ""))
    if own:
        side["model_args"] = {**own, **(side.get("model_args") or {})}
    return side


# SigLIP 2's towers in timm's vision_transformer.py pass act_layer='gelu_tanh' themselves; the
# SigLIP 1 ones (vit_base_patch16_siglip_224, ...) keep nn.GELU's exact form
_SIGLIP2 = ("vit_base_patch32_siglip_256", "vit_large_patch16_siglip_512",
            "vit_so400m_patch16_siglip_256", "vit_so400m_patch16_siglip_384",
            "vit_so400m_patch16_siglip_512", "vit_giantopt_patch16_siglip_256",
            "vit_giantopt_patch16_siglip_384")
_GELU_TANH = frozenset(_SIGLIP2 + tuple(n.replace("_siglip_", "_siglip_gap_") for n in _SIGLIP2))
# registrations passing pool_include_prefix=True (attention pooling over the register too)
_POOL_INCLUDE_PREFIX = frozenset({"test_vit3"})


def _own_args(architecture: str) -> dict:
    """The model_args timm's registration of ``architecture`` passes itself (timm 1.0.x) that
    change the numbers but not the weights' names: a hub config.json records the caller's
    arguments only. (The CLIP towers' LayerNorm epsilon is ``_norm_eps``'s.)"""
    args = {}
    if "quickgelu" in architecture:
        args["act_layer"] = "quick_gelu"
    elif architecture in _GELU_TANH:
        args["act_layer"] = "gelu_tanh"
    if architecture in _POOL_INCLUDE_PREFIX:
        args["pool_include_prefix"] = True
    return args


def canonical(tensors: dict[str, np.ndarray], notes: list[str]) -> dict[str, np.ndarray]:
    """timm's names (a DDP prefix is read_tensors'); facebookresearch/dinov2's own release
    (its torch.hub files, dinov2_vitb14_pretrain.pth ...) renamed as timm's loader renames it."""
    if "mask_token" in tensors and "patch_embed.proj.weight" in tensors:
        return _from_dinov2_release(tensors, notes)
    return tensors


def _from_dinov2_release(tensors: dict[str, np.ndarray], notes: list[str]) -> dict:
    """DINOv2's release layout -> timm's ``vit_*_dinov2`` (timm's ``_convert_dinov2``): the
    mask token is training's alone; registers are timm's ``reg_token``, and with them the class
    token's row of the position table moves into the class token (timm's register models give
    the table to the patches alone: the same sums at every grid); the giant's packed SwiGLU
    ``w12`` / ``w3`` are ``fc1`` / ``fc2``."""
    out = {key: value for key, value in tensors.items() if key != "mask_token"}
    said = ["its mask token dropped (training's alone)"]
    if "register_tokens" in out:
        odd = [f"no {key!r}" for key in ("cls_token", "pos_embed") if key not in out]
        odd += ["a 'reg_token' too"] if "reg_token" in out else []
        if odd:  # the release's register models have a class token and a table beside them
            raise ConvertError(f"timm checkpoint: facebookresearch/dinov2's release layout (a "
                               f"mask token, register_tokens) with {', '.join(odd)}: not such "
                               "a file whole")
        table = out.pop("pos_embed")
        out["reg_token"] = out.pop("register_tokens")
        out["cls_token"] = out["cls_token"] + table[:, :1]
        out["pos_embed"] = table[:, 1:]
        said.append("registers read as timm's reg_token, the class token's position row added "
                    "to the class token")
    for key in [k for k in out if re.fullmatch(r"blocks\.\d+\.mlp\.w(12|3)\.(weight|bias)", k)]:
        out[key.replace(".w12.", ".fc1.").replace(".w3.", ".fc2.")] = out.pop(key)
    notes.append(f"facebookresearch/dinov2's release layout, read as timm reads it: "
                 f"{'; '.join(said)}")
    return out


def infer_config(t: SourceTensors, hints: Hints, side: dict) -> ViTConfig:
    if side.get("architecture"):  # every message names it
        t.source = f"timm {side['architecture']}"
    if convert_timm_dinov3.is_dinov3(side):  # eva.py's DINOv3 port: transformers' layout
        return convert_timm_dinov3.infer_config(t, hints, side)
    t.refuse("blocks.0.attns.0.norm.weight", "a block of parallel attention and MLP branches "
             "(timm ParallelThingsBlock, the *_18x2_* models)")
    blocks = "blocks.0.norm1.weight" in t or "blocks.0.in_norm.weight" in t
    if "patch_embed.proj.weight" not in t or not blocks:
        raise ConvertError(
            f"{t.source} checkpoint: not a timm VisionTransformer (no patch_embed.proj and "
            f"blocks.0.norm1 / blocks.0.in_norm); its keys begin: {t.some_keys()}"
        )
    _refuse_architecture(t, side)
    for key, what in (
        ("blocks.0.mlp.fc1_g.weight", "a SwiGLU MLP with its gate and value apart (timm SwiGLU; "
         "the packed SwiGLUPacked is supported)"),
        ("patch_embed.norm.weight", "a norm inside the patch embedding"),
        ("attn_pool.q_norm.weight", "QK-norm in the attention-pooling head"),
        ("attn_pool.pos_embed", "a position embedding in the attention-pooling head"),
        ("blocks.0.attn.norm.weight", "a norm inside attention (timm scale_attn_norm)"),
        ("blocks.0.mlp.norm.weight", "a norm inside the MLP (timm scale_mlp_norm)"),
        ("blocks.0.attn.lambda_q1", "differential attention (timm attn_layer='diff')"),
        ("blocks.0.lambda_q1", "differential attention (timm DiffParallelScalingBlock)"),
        ("blocks.0.gamma_1", "an Eva block's LayerScale (timm's Eva models: rotary position "
         "embeddings, their own blocks)"),
    ):
        t.refuse(key, what)
    pool_norm = "fc_norm.weight" in t  # timm's fc_norm: the final norm after average pooling
    if pool_norm:
        t.refuse("norm.weight", "a norm on the tokens and another after pooling (timm norm "
                 "and fc_norm together)")
    elif "norm.weight" not in t:
        raise ConvertError(
            f"{t.source} checkpoint: no final norm ('norm.weight'): models without one (timm "
            "final_norm=False) are not supported"
        )
    if "pos_embed" not in t:
        raise ConvertError(
            f"{t.source} checkpoint: no 'pos_embed': models without a learned "
            "position embedding are not supported"
        )
    model_args = side.get("model_args") or {}
    width, channels, patch = patch_conv(t, "patch_embed.proj.weight")
    depth = count_blocks(t, r"blocks\.(\d+)\.")
    parallel = "blocks.0.in_proj.weight" in t
    class_token = "cls_token" in t
    distilled = "dist_token" in t  # VisionTransformerDistilled (DeiT): served as one register
    if distilled and "reg_token" in t:
        t.refuse("dist_token", "a distillation token beside register tokens")
    registers = t.shape("reg_token")[1] if "reg_token" in t else int(distilled)
    grid, covers_cls, covers_registers = _table_grid(t, side, patch, class_token, registers)
    first_norm = "blocks.0.in_norm" if parallel else "blocks.0.norm1"
    norm = _norm(t, model_args, hints, f"{first_norm}.bias" in t)
    qk_key = "blocks.0.q_norm.weight" if parallel else "blocks.0.attn.q_norm.weight"
    heads = infer_heads(t, hints, qk_key, width, model_args.get("num_heads"))
    if parallel:
        mlp_dim = t.shape("blocks.0.in_proj.weight")[0] - 3 * width
        qkv_bias = "blocks.0.in_proj.bias" in t
        out_bias = "blocks.0.attn_out_proj.bias" in t or "blocks.0.out_proj.bias" in t
        mlp_bias = True  # timm's parallel block always has one (mlp_bias, or inside in_proj.bias)
    else:
        mlp_dim = t.shape("blocks.0.mlp.fc2.weight")[1]
        qkv_bias = "blocks.0.attn.qkv.bias" in t
        out_bias = "blocks.0.attn.proj.bias" in t
        mlp_bias = "blocks.0.mlp.fc1.bias" in t
    pool = side.get("global_pool")
    if model_args.get("pool_include_prefix"):
        raise ConvertError(
            f"{t.source} checkpoint: pool_include_prefix=True (the pooling reads the class and "
            "register tokens too) is not supported: the model pools the patch tokens only"
        )
    if distilled:  # its forward_head: pre-logits (CLS + distillation) / 2, whatever global_pool
        head = "prefix"
        t.notes.append("the distillation token is served as the one register token; pooled is "
                       "the mean of the class and distillation tokens (timm's pre-logits)")
    elif "attn_pool.latent" in t:
        head = "map"
        if t.shape("attn_pool.latent")[1] != 1:
            t.refuse("attn_pool.latent", "an attention-pooling head with several latent queries")
    elif class_token and (pool == "token" or (pool is None and not pool_norm)):
        head = "cls"
        if pool is None:  # a bare state dict: an average-pooled model's weights look the same
            t.notes.append("no timm config.json giving global_pool: pooled output read as the "
                           "class token (timm's default, global_pool='token')")
    elif pool in (None, "avg"):
        head = "gap"
        if pool is None:  # max and avgmax pooled models' weights look the same (timm gives
            # them fc_norm too; a bare file with fc_norm and a class token is read so as well)
            t.notes.append("no timm config.json giving global_pool: pooled output read as the "
                           "average of the patch tokens (global_pool='avg')")
    else:
        raise ConvertError(f"{t.source} checkpoint: global_pool={pool!r} is not supported")
    head_mlp = t.shape("attn_pool.mlp.fc1.weight")[0] if head == "map" else None
    gated = not parallel and t.shape("blocks.0.mlp.fc1.weight")[0] == 2 * mlp_dim  # SwiGLUPacked
    mlp, gelu_exact = _gated(side, t) if gated else _activation(side, t)
    sizes = Sizes(width, depth, heads, mlp_dim, patch, grid, channels, head_mlp)
    cfg = sizes.config(
        patch_bias="patch_embed.proj.bias" in t,  # timm's pre-norm models have none
        block="parallel" if parallel else "sequential",
        norm=norm,
        norm_eps=_norm_eps(side, t),
        qkv_bias=qkv_bias,
        out_bias=out_bias,
        mlp_bias=mlp_bias,
        qk_norm=qk_key in t,
        head=head,
        pool_norm=pool_norm,
        class_token=class_token,
        num_registers=registers,
        posemb_covers_cls=covers_cls,
        posemb_covers_registers=covers_registers,
        posemb_resample="bicubic_antialias",  # resample_abs_pos_embed's defaults
        pre_norm="norm_pre.weight" in t,
        gelu_exact=gelu_exact,
        mlp=mlp,
        num_classes=t.shape("head.weight")[0] if "head.weight" in t and not distilled else 0,
    )
    _check_side(t, side, cfg)
    return cfg


def _check_side(t: SourceTensors, side: dict, cfg: ViTConfig) -> None:
    """config.json's num_classes and model_args, where it gives them, must be the weights'
    (pretrained_cfg's input size is what timm's transforms give: the served crop)."""
    args = side.get("model_args") or {}
    classes = t.shape("head.weight")[0] if "head.weight" in t else 0  # served or not (DeiT)
    claims = {
        "num_classes": (side.get("num_classes"), classes),
        "model_args.num_classes": (args.get("num_classes"), classes),
        "model_args.embed_dim": (args.get("embed_dim"), cfg.width),
        "model_args.depth": (args.get("depth"), cfg.depth),
        "model_args.num_heads": (args.get("num_heads"), cfg.heads),
        "model_args.patch_size": (_square(args.get("patch_size")), cfg.patch),
    }  # model_args.img_size is the position table's (_table_grid)
    check_claims(t.source, "config.json", claims)


def _square(size) -> int | None:
    """timm's sizes: an int, or [h, w] (the weights' are square: a non-square one never is)."""
    if isinstance(size, (list, tuple)):
        return size[0] if len(set(size)) == 1 else tuple(size)
    return size


# timm's norm_layer names (timm.layers.create_norm) -> ours; the fp32 ones compute in float32 as
# the others do here. SimpleNorm (x / sqrt(unbiased var(x))) is neither.
_NORMS = {"layernorm": "layernorm", "layernormfp32": "layernorm", "rmsnorm": "rmsnorm",
          "rmsnormfp32": "rmsnorm"}


def _norm(t: SourceTensors, model_args: dict, hints: Hints, biased: bool) -> str:
    """config.json's model_args.norm_layer where given; else a norm with a bias is LayerNorm and
    one without RMSNorm (a preset may say LayerNorm without bias)."""
    named = model_args.get("norm_layer")
    if named is not None:
        if named not in _NORMS:
            raise ConvertError(f"{t.source} checkpoint: norm_layer={named!r} is not supported "
                               f"(supported: {', '.join(_NORMS)})")
        return _NORMS[named]
    if biased:
        return "layernorm"
    if hints.preset and hints.preset.norm in ("rmsnorm", "layernorm_nobias"):
        return hints.preset.norm
    t.notes.append("norms without a bias read as RMSNorm (timm's bias-free norm)")
    return "rmsnorm"


# timm's act_layer names (timm.layers.create_act) -> (mlp, gelu_exact)
_ACTIVATIONS = {"gelu": ("gelu", True), "gelu_tanh": ("gelu", False),
                "quick_gelu": ("quick_gelu", True)}


def _activation(side: dict, t: SourceTensors) -> tuple[str, bool]:
    """timm's MLP activation is code, not weights: config.json's model_args.act_layer, or the
    architecture's own (``_own_args``); else timm's default, the exact GELU."""
    act = (side.get("model_args") or {}).get("act_layer")
    if act is not None:
        if act not in _ACTIVATIONS:
            raise ConvertError(
                f"{t.source} checkpoint: act_layer={act!r} is not supported "
                f"(supported: {', '.join(_ACTIVATIONS)})"
            )
        return _ACTIVATIONS[act]
    if not side.get("architecture"):
        t.notes.append("no timm config.json naming the architecture: the MLP's GELU read as exact")
    return "gelu", True


def _norm_eps(side: dict, t: SourceTensors) -> float:
    """timm's CLIP towers build their norms with OpenAI's eps, 1e-5, as its BEiT-3 and AIMv2
    registrations do; every other ViT with 1e-6."""
    architecture = str(side.get("architecture", ""))
    if not architecture and "norm_pre.weight" in t:
        t.notes.append("no timm config.json naming the architecture: LayerNorm epsilon read as "
                       "1e-6 (timm's ViTs; its CLIP towers, which have this norm before the "
                       "blocks too, use 1e-5)")
    wide = "_clip_" in architecture or architecture.startswith(("beit3_", "aimv2_"))
    return 1e-5 if wide else 1e-6


def _gated(side: dict, t: SourceTensors) -> tuple[str, bool]:
    """A packed gated MLP: SwiGLU (SiLU on the first half: timm's SwiGLUPacked as its DINOv2
    giants build it). timm's Block hands its act_layer to the MLP, so config.json's must be
    SiLU; another packed GLU (GluMlp's gate is the second half) is refused."""
    args = side.get("model_args") or {}
    act, layer = args.get("act_layer"), args.get("mlp_layer")
    if layer is not None and layer != "SwiGLUPacked":
        raise ConvertError(f"{t.source} checkpoint: mlp_layer={layer!r} is not supported "
                           "(a gated MLP must be SwiGLUPacked)")
    if act is not None and act not in ("silu", "swish"):
        raise ConvertError(f"{t.source} checkpoint: a gated MLP with act_layer={act!r} is not "
                           "supported (only silu: SwiGLU)")
    if act is None:
        t.notes.append("no timm config.json giving act_layer: the gated MLP read as SwiGLU (SiLU "
                       "on the first half, timm's SwiGLUPacked)")
    return "swiglu", True


# timm's eva.py architectures (1.0.x); eva_large_patch14_* are vision_transformer.py's own
_EVA_PREFIXES = ("eva02_", "eva_giant_", "vit_pe_")
_EVA_MARKS = ("_rope_", "_dinov3", "_lingbot", "_sapiens2")


# VisionTransformer's arguments (timm 1.0.x), each read below, shown by the weights, or without
# effect at inference; a key outside them (a newer timm's option) is refused, not ignored: an
# option left unread converts to other features without a word.
_VIT_ARGS = frozenset((
    "img_size", "patch_size", "in_chans", "num_classes", "global_pool", "embed_dim", "depth",
    "num_heads", "mlp_ratio", "qkv_bias", "qk_norm", "scale_attn_norm", "scale_mlp_norm",
    "proj_bias", "init_values", "class_token", "pos_embed", "no_embed_class", "reg_tokens",
    "pre_norm", "final_norm", "fc_norm", "pool_include_prefix", "dynamic_img_size",
    "dynamic_img_pad", "embed_layer", "embed_norm_layer", "norm_layer", "act_layer", "block_fn",
    "mlp_layer", "attn_layer", "drop_rate", "pos_drop_rate", "patch_drop_rate", "proj_drop_rate",
    "attn_drop_rate", "drop_path_rate", "weight_init", "fix_init",
))


def _refuse_architecture(t: SourceTensors, side: dict) -> None:
    """timm models whose weights can look like a VisionTransformer's but compute otherwise:
    post-norm residual blocks (ResPostBlock, the *_rpn_* models) and rotary position embeddings
    (timm's eva.py), told by config.json's architecture and model_args."""
    architecture = str(side.get("architecture", ""))
    args = side.get("model_args") or {}
    why = None
    if "_rpn_" in architecture or args.get("block_fn") == "ResPostBlock":
        why = "post-norm residual blocks (ResPostBlock)"
    elif args.get("block_fn") not in (None, "Block", "ParallelScalingBlock"):
        why = f"block_fn={args['block_fn']!r}"
    elif (architecture.startswith(_EVA_PREFIXES) or any(m in architecture for m in _EVA_MARKS)
          or args.get("use_rot_pos_emb")):
        why = "timm's Eva models (rotary position embeddings, their own blocks)"
    if why:
        raise ConvertError(f"{t.source} checkpoint: not supported: {why}")
    for key, value in args.items():
        if key not in _VIT_ARGS:
            raise ConvertError(f"{t.source} checkpoint: config.json model_args.{arg_name(key)}="
                               f"{value!r} is not an option this converter reads for timm's "
                               "VisionTransformer; refusing to convert rather than ignore it")
    if args.get("embed_layer") not in (None, "PatchEmbed"):
        raise ConvertError(f"{t.source} checkpoint: config.json model_args.embed_layer="
                           f"{args['embed_layer']!r} is not supported (only PatchEmbed)")


def _square_count(n: int) -> bool:
    return math.isqrt(n) ** 2 == n


def _table_grid(t: SourceTensors, side: dict, patch: int, class_token: bool,
                registers: int) -> tuple[int, bool, bool]:
    """The position table's grid side and whether it covers the class token and the registers.

    timm's ``no_embed_class=False`` (its default) gives every prefix token a row of the table
    too; ``no_embed_class=True`` none. model_args.img_size, the size the model was built at,
    tells the grid where config.json gives it (a non-square one is refused). Without it the
    table is read as a square grid, after the prefix tokens or not by its length, and a note
    says so."""
    args = side.get("model_args") or {}
    n_pos, prefix = t.shape("pos_embed")[1], int(class_token) + registers
    size = args.get("img_size")
    if size is not None:
        height, width = size if isinstance(size, (list, tuple)) else (size, size)
        if height != width:
            raise ConvertError(f"{t.source} checkpoint: config.json's model_args.img_size={size}, "
                               "a non-square input: only square patch grids are supported")
        grid = height // patch
        extra = n_pos - grid * grid
        if registers and extra == prefix:
            return grid, class_token, True
        if extra not in (0, int(class_token)):
            raise ConvertError(
                f"{t.source} checkpoint: its position table's {n_pos} rows are not the "
                f"{grid}x{grid} patches of model_args.img_size={size} (with or without the "
                f"{prefix} prefix tokens)"
            )
        return grid, extra == 1, False
    rows = n_pos - prefix
    if registers and rows > 0 and _square_count(rows):
        covered = args.get("no_embed_class") is False or (
            args.get("no_embed_class") is None and not _square_count(n_pos))
        if covered:
            return math.isqrt(rows), class_token, True
        if args.get("no_embed_class") is None:
            t.notes.append(f"no timm config.json giving no_embed_class: the position table's "
                           f"{n_pos} rows read as the patches' alone, not as {rows} patches "
                           "after the prefix tokens")
    grid, covers_cls = grid_of(n_pos, class_token, t.source)
    if not (side.get("pretrained_cfg") or {}).get("input_size"):
        t.notes.append(f"no timm config.json giving img_size: the position table read as a "
                       f"square {grid}x{grid} grid")
    return grid, covers_cls, False


def preprocessing(side: dict, image_size: int) -> SourcePreprocess:
    """pretrained_cfg as timm's resolve_data_config reads it (bicubic, ImageNet mean/std and
    crop_pct 0.875 where it is silent); timm's eval transform resizes the shorter side to
    floor(input size / crop_pct), then centre-crops ('center' crop_mode). Without a
    pretrained_cfg: timm's ViT defaults (Inception mean/std 0.5, bicubic, crop_pct 0.9)."""
    cfg = side.get("pretrained_cfg") or {}
    if not cfg:
        where, half = "timm defaults (no pretrained_cfg in config.json)", (0.5, 0.5, 0.5)
        resize = math.floor(image_size / 0.9)
        return SourcePreprocess(where, False, resize, image_size, "bicubic", half, half)
    where = "config.json pretrained_cfg"
    height, width = (cfg.get("input_size") or (3, image_size, image_size))[-2:]
    if height != width:
        raise ConvertError(
            f"timm {where}: input_size {cfg['input_size']} is not square, which the pixel "
            "contract cannot serve"
        )
    resize = math.floor(height / float(cfg.get("crop_pct") or 0.875))
    mode = cfg.get("crop_mode") or "center"
    # squash: both sides to floor(input size / crop_pct), then the centre crop (none at crop_pct 1)
    squash = mode == "squash"
    kinds = {"center": "shortest", "squash": "squash", "border": "longest"}
    geometry = None if squash else unservable("crop_mode", mode, resize, kinds)
    return SourcePreprocess(
        where,
        True,
        resize=resize,
        crop=int(height),
        interpolation=cfg.get("interpolation") or "bicubic",
        mean=tuple(cfg.get("mean") or IMAGENET_MEAN),
        std=tuple(cfg.get("std") or IMAGENET_STD),
        geometry=geometry,
        squash=squash,
    )


def _timm_sequential_block(t: SourceTensors, b: str, cfg: ViTConfig) -> dict:
    d, h, mlp = cfg.width, cfg.heads, cfg.mlp_dim
    p = {"norm1": torch_norm(t, b + "norm1", cfg), "norm2": torch_norm(t, b + "norm2", cfg)}
    w_qkv, b_qkv = torch_linear(t, b + "attn.qkv", 3 * d, d, cfg.qkv_bias)
    p["w_qkv"] = fused_to_heads(w_qkv, 3, h)
    if cfg.qkv_bias:
        p["b_qkv"] = fused_bias_to_heads(b_qkv, 3, h)
    if cfg.qk_norm:
        p["q_norm"] = torch_norm(t, b + "attn.q_norm", cfg, cfg.head_dim)
        p["k_norm"] = torch_norm(t, b + "attn.k_norm", cfg, cfg.head_dim)
    w_o, b_o = torch_linear(t, b + "attn.proj", d, d, cfg.out_bias)
    gated = cfg.mlp == "swiglu"  # GluMlp(gate_last=False): fc1 = [gate | value]
    w_fc1, b_fc1 = torch_linear(t, b + "mlp.fc1", (1 + gated) * mlp, d, cfg.mlp_bias)
    w_fc2, b_fc2 = torch_linear(t, b + "mlp.fc2", d, mlp, cfg.mlp_bias)
    fold_layer_scale(t, b + "ls1.gamma", d, w_o, b_o)
    fold_layer_scale(t, b + "ls2.gamma", d, w_fc2, b_fc2)
    p["w_o"] = split_heads_out(w_o, h)
    if gated:
        p["w_gate"], w_fc1 = w_fc1[:, :mlp], w_fc1[:, mlp:]
        if b_fc1 is not None:
            p["b_gate"], b_fc1 = b_fc1[:mlp], b_fc1[mlp:]
    p["w_fc1"], p["w_fc2"] = w_fc1, w_fc2
    for name, value in (("b_o", b_o), ("b_fc1", b_fc1), ("b_fc2", b_fc2)):
        if value is not None:
            p[name] = value
    return p


def _timm_parallel_block(t: SourceTensors, b: str, cfg: ViTConfig) -> dict:
    d, h, hd, mlp = cfg.width, cfg.heads, cfg.head_dim, cfg.mlp_dim
    p = {"norm": torch_norm(t, b + "in_norm", cfg)}
    w_in, b_in = torch_linear(t, b + "in_proj", mlp + 3 * d, d, cfg.qkv_bias)
    w_mlp, w_q, w_k, w_v = np.split(w_in, [mlp, mlp + d, mlp + 2 * d], axis=1)  # mlp|q|k|v
    p["w_in"] = np.concatenate([split_heads_in(w, h) for w in (w_q, w_k, w_v, w_mlp)], axis=-1)
    if cfg.qkv_bias:  # in_proj.bias carries the MLP's bias too
        b_mlp, b_q, b_k, b_v = np.split(b_in, [mlp, mlp + d, mlp + 2 * d])
        p["b_qkv"] = np.concatenate([x.reshape(h, hd) for x in (b_q, b_k, b_v)], axis=-1)
    else:
        b_mlp = t.take(b + "mlp_bias", (mlp,))
    p["b_mlp"] = b_mlp.reshape(h, -1)
    if cfg.qk_norm:
        p["q_norm"] = torch_norm(t, b + "q_norm", cfg, hd)
        p["k_norm"] = torch_norm(t, b + "k_norm", cfg, hd)
    if b + "out_proj.weight" in t:  # fuse_out_proj=True: input is concat(attn, mlp)
        w_out, b_out = torch_linear(t, b + "out_proj", d, d + mlp, cfg.out_bias)
        w_attn, w_mlp_out = w_out[:d], w_out[d:]
    else:
        w_attn, b_attn = torch_linear(t, b + "attn_out_proj", d, d, cfg.out_bias)
        w_mlp_out, b_mlp_out = torch_linear(t, b + "mlp_out_proj", d, mlp, cfg.out_bias)
        b_out = b_attn + b_mlp_out if cfg.out_bias else None
    if b_out is None:
        b_out = np.zeros((d,), np.float32)  # our block adds one out-bias; timm had none here
    w_out = np.concatenate([split_heads_out(w_attn, h), split_heads_out(w_mlp_out, h)], axis=1)
    fold_layer_scale(t, b + "ls.gamma", d, w_out, b_out)
    p["w_out"], p["b_out"] = w_out, b_out
    return p


def _timm_map_head(t: SourceTensors, cfg: ViTConfig) -> dict:
    d, h, m = cfg.width, cfg.heads, cfg.map_mlp_dim
    w_q, b_q = torch_linear(t, "attn_pool.q", d, d, True)
    w_kv, b_kv = torch_linear(t, "attn_pool.kv", 2 * d, d, True)
    w_o, b_o = torch_linear(t, "attn_pool.proj", d, d, True)
    w_fc1, b_fc1 = torch_linear(t, "attn_pool.mlp.fc1", m, d, True)
    w_fc2, b_fc2 = torch_linear(t, "attn_pool.mlp.fc2", d, m, True)
    return {
        "probe": t.take("attn_pool.latent", (1, 1, d)),
        "w_q": split_heads_in(w_q, h),
        "b_q": b_q.reshape(h, -1),
        "w_kv": fused_to_heads(w_kv, 2, h),
        "b_kv": fused_bias_to_heads(b_kv, 2, h),
        "w_o": split_heads_out(w_o, h),
        "b_o": b_o,
        "norm": torch_norm(t, "attn_pool.norm", cfg),
        "w_fc1": w_fc1,
        "b_fc1": b_fc1,
        "w_fc2": w_fc2,
        "b_fc2": b_fc2,
    }


def build_params(t: SourceTensors, cfg: ViTConfig) -> dict:
    if t.family:  # read through another importer's layout (infer_config says which)
        return convert_timm_dinov3.build_params(t, cfg)
    d, c, p = cfg.width, cfg.channels, cfg.patch
    table = cfg.table_rows(cfg.table_grid)  # the stored grid (posemb_grid)
    params = {
        "patch_embed": patch_kernel(t.take("patch_embed.proj.weight", (d, c, p, p))),
        "pos_embedding": t.take("pos_embed", (1, table, d)),
        "encoder_norm": torch_norm(t, "fc_norm" if cfg.pool_norm else "norm", cfg),
    }
    if cfg.patch_bias:
        params["patch_bias"] = t.take("patch_embed.proj.bias", (d,))
    if cfg.class_token:
        params["cls"] = t.take("cls_token", (1, 1, d))
    if cfg.num_registers:
        key = "dist_token" if "dist_token" in t else "reg_token"
        params["registers"] = t.take(key, (1, cfg.num_registers, d))
    if "dist_token" in t:  # VisionTransformerDistilled: logits average two heads' on two tokens
        for key in ("head.weight", "head.bias", "head_dist.weight", "head_dist.bias"):
            t.drop(key, "the distilled model's two classifiers (logits: the mean of the class "
                   "token's and the distillation token's) are not served; the features are")
    if cfg.pre_norm:
        params["pre_norm"] = torch_norm(t, "norm_pre", cfg)
    block = _timm_parallel_block if cfg.block == "parallel" else _timm_sequential_block
    for i in range(cfg.depth):
        params[f"block_{i}"] = block(t, f"blocks.{i}.", cfg)
    if cfg.head == "map":
        params["map_head"] = _timm_map_head(t, cfg)
    if cfg.num_classes:
        kernel, bias = torch_linear(t, "head", cfg.num_classes, d, True)
        params["classifier"], params["classifier_bias"] = kernel, bias
    return params
