"""timm's DINOv3 port (eva.py's ``vit_*_dinov3*``): the Hugging Face DINOv3 model under timm's
names, read by renaming its tensors to transformers' ``DINOv3ViTModel`` layout and converting
that (``convert_hf``), so one set of rules reads both releases of the same weights.

What timm's config changes without changing the weights' names is checked here: the rotary
embedding (``rope_type='dinov3'`` with rotate-half pairs, base ``rope_temperature``), the MLP's
activation, and the pooled output (timm's default for these models averages the patch tokens;
``global_pool='token'`` is the class token, as upstream and transformers pool).
"""

from __future__ import annotations

import numpy as np

from . import convert_hf
from .config import ViTConfig
from .convert_common import ConvertError, Hints, SourceTensors, arg_name

# the heads each registration passes itself (timm 1.0.x); a hub config.json records only the
# caller's own arguments
_HEADS = {"tiny": 3, "small": 6, "small_plus": 6, "base": 12, "large": 16, "huge_plus": 20,
          "7b": 32}
# timm act_layer -> transformers hidden_act (the plain MLP's; SwiGLU's is silu)
_ACTS = {None: "gelu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh",
         "quick_gelu": "quick_gelu"}
_BLOCK_KEYS = (  # timm name -> transformers name, within a block
    ("norm1.", "norm1."),
    ("norm2.", "norm2."),
    ("attn.q_bias", "attention.q_proj.bias"),
    ("attn.v_bias", "attention.v_proj.bias"),
    ("attn.proj.", "attention.o_proj."),
    ("attn.q_proj.", "attention.q_proj."),  # qkv_fused=False: transformers' own three
    ("attn.k_proj.", "attention.k_proj."),
    ("attn.v_proj.", "attention.v_proj."),
    ("gamma_1", "layer_scale1.lambda1"),
    ("gamma_2", "layer_scale2.lambda1"),
    ("mlp.fc1_g.", "mlp.gate_proj."),
    ("mlp.fc1_x.", "mlp.up_proj."),
    ("mlp.fc1.", "mlp.up_proj."),
    ("mlp.fc2.", "mlp.down_proj."),
)
_MODEL_KEYS = (
    ("cls_token", "embeddings.cls_token"),
    ("reg_token", "embeddings.register_tokens"),
    ("patch_embed.proj.", "embeddings.patch_embeddings."),
    ("norm.", "norm."),
    ("head.", "classifier."),
)


def is_dinov3(side: dict) -> bool:
    args = side.get("model_args") or {}
    return "_dinov3" in str(side.get("architecture", "")) or args.get("rope_type") == "dinov3"


def infer_config(t: SourceTensors, hints: Hints, side: dict) -> ViTConfig:
    """The config of timm's DINOv3 weights in ``t`` (renamed in place to transformers' names:
    ``build_params`` is then ``convert_hf``'s)."""
    args = side.get("model_args") or {}
    _refuse(t, args)
    swiglu = "blocks.0.mlp.fc1_g.weight" in t
    act = "silu" if swiglu else _ACTS.get(args.get("act_layer"))
    if act is None:
        raise ConvertError(f"{t.source} checkpoint: act_layer={args['act_layer']!r} is not "
                           f"supported (supported: {', '.join(a for a in _ACTS if a)})")
    heads = args.get("num_heads") or _registered_heads(side)
    if hints.heads and heads and hints.heads != heads:  # said here in timm's words
        where = "config.json's model_args" if args.get("num_heads") else "the architecture's"
        raise ConvertError(f"{t.source} checkpoint: --heads {hints.heads} contradicts {where} "
                           f"num_heads={heads}")
    t.tensors = _renamed(t)
    size = (side.get("pretrained_cfg") or {}).get("input_size")
    if size and size[-1] != size[-2]:
        raise ConvertError(f"{t.source} checkpoint: config.json pretrained_cfg.input_size="
                           f"{size}, a non-square input; only square inputs are served")
    hf_side = {
        "model_type": "dinov3_vit",
        "hidden_act": act,
        "layer_norm_eps": 1e-5,  # every registration's LayerNorm (timm passes it in code)
        "rope_theta": float(args.get("rope_temperature", 100.0)),
        "image_size": size[-1] if size else args.get("img_size", 224),
        "num_attention_heads": heads,
    }
    cfg = convert_hf.infer_config(t, hints, {k: v for k, v in hf_side.items() if v is not None})
    pool = side.get("global_pool", args.get("global_pool"))
    if pool == "token":
        return cfg
    if pool not in (None, "avg"):
        raise ConvertError(f"{t.source} checkpoint: global_pool={pool!r} is not supported")
    if pool is None:
        t.notes.append("no timm config.json giving global_pool: pooled output read as the "
                       "average of the patch tokens (these models' default, global_pool='avg')")
    return cfg.replace(head="gap")


def build_params(t: SourceTensors, cfg: ViTConfig) -> dict:
    return convert_hf.build_params(t, cfg)


# timm's Eva arguments as a hub config.json records them (the caller's own). Each is read
# here, shown by the weights, or without effect at inference; any other, or another value of
# one that must keep DINOv3's, is refused by name (one such left unread converted a model whose
# features differed by up to 63%: use_post_norm).
_DINOV3_VALUES = {  # the value DINOv3 uses; another changes the forward, not the weights' names
    "rope_type": "dinov3", "rope_rotate_half": True, "use_rot_pos_emb": True,
    "use_abs_pos_emb": False, "rope_grid_offset": 0.0, "rope_grid_indexing": "ij",
    "use_post_norm": False, "rope_mrope_section": None, "ref_feat_shape": None,
    "num_kv_heads": None, "in_chans": 3,
}
_READ_ELSEWHERE = frozenset((  # read below, by convert_hf from the weights, or no-ops here
    "img_size", "patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio", "num_classes",
    "global_pool", "act_layer", "rope_temperature", "qkv_bias", "qkv_fused", "qk_norm",
    "swiglu_mlp", "swiglu_align_to", "scale_mlp", "scale_attn_inner", "init_values",
    "attn_only_layer_scale", "class_token", "num_reg_tokens", "no_embed_class",
    "use_pre_transformer_norm", "use_post_transformer_norm", "use_fc_norm",
    "attn_pool_num_heads", "attn_pool_mlp_ratio", "dynamic_img_size", "dynamic_img_pad",
    "attn_type", "head_init_scale",
    # training only: dropout, stochastic depth, and DINOv3's augmentation of rotary coordinates
    "drop_rate", "pos_drop_rate", "patch_drop_rate", "proj_drop_rate", "attn_drop_rate",
    "drop_path_rate", "rope_shift_coords", "rope_jitter_coords", "rope_rescale_coords",
))
_WEIGHTS_SAY = (  # a timm option the weights show, named as the user set it
    ("blocks.0.attn.q_norm.weight", "a norm of queries and keys (timm qk_norm=True)"),
    ("norm_pre.weight", "a norm before the blocks (timm use_pre_transformer_norm=True)"),
    ("blocks.0.attn.norm.weight", "a norm inside attention (timm scale_attn_inner)"),
    ("blocks.0.mlp.norm.weight", "a norm inside the MLP (timm scale_mlp)"),
    ("fc_norm.weight", "a norm after pooling (timm use_fc_norm)"),
    ("pos_embed", "an absolute position table beside the rotary embedding"),
)


def _refuse(t: SourceTensors, args: dict) -> None:
    """What timm's config changes in the numbers and the weights do not show, and the options
    the weights do show, named as timm's."""
    for key, value in args.items():
        if key in _DINOV3_VALUES:
            want = _DINOV3_VALUES[key]
            same = value == want and type(value) is type(want) or (
                isinstance(want, float) and isinstance(value, int | float)
                and not isinstance(value, bool) and float(value) == want)
            if not same:
                raise ConvertError(f"{t.source} checkpoint: config.json model_args.{key}="
                                   f"{value!r} is not supported (DINOv3's is {want!r})")
        elif key not in _READ_ELSEWHERE:
            raise ConvertError(f"{t.source} checkpoint: config.json model_args.{arg_name(key)}"
                               f"={value!r} "
                               "is not an option this converter reads for timm's DINOv3 port; "
                               "refusing to convert rather than ignore it")
    for key, what in _WEIGHTS_SAY:
        t.refuse(key, what)
    if "cls_token" not in t:
        raise ConvertError(f"{t.source} checkpoint: no class token (timm class_token=False); "
                           "DINOv3's models have one, and this converter reads only those")
    if "norm.weight" not in t:
        raise ConvertError(f"{t.source} checkpoint: no final norm (timm "
                           "use_post_transformer_norm=False or norm_layer=None); DINOv3's "
                           "features are normed, and this converter reads only those")


def _registered_heads(side: dict) -> int | None:
    """The heads the architecture's registration passes (vit_{size}_patch16_dinov3[_qkvb])."""
    name = str(side.get("architecture", "")).removeprefix("vit_")
    size = name.split("_patch", 1)[0]
    return _HEADS.get(size) if name.endswith(("_dinov3", "_dinov3_qkvb")) else None


def _renamed(t: SourceTensors) -> dict:
    """``t``'s tensors under transformers' DINOv3 names; the fused qkv split in three."""
    out = {}
    if "reg_token" not in t:  # timm keeps no tensor for num_reg_tokens=0; transformers an empty one
        out["embeddings.register_tokens"] = np.zeros((1, 0, t.shape("cls_token")[-1]), np.float32)
    for key, value in t.tensors.items():
        out[_rename(key)] = value
        if key.startswith("blocks.") and key.endswith(".attn.qkv.weight"):
            rows = value.shape[0] // 3 if value.ndim == 2 and value.shape[0] % 3 == 0 else 0
            if rows:
                del out[_rename(key)]
                prefix = key.removesuffix("attn.qkv.weight").replace("blocks.", "layer.", 1)
                for i, name in enumerate("qkv"):
                    out[f"{prefix}attention.{name}_proj.weight"] = value[i * rows:(i + 1) * rows]
    return out


def _rename(key: str) -> str:
    if key.startswith("blocks."):
        index, _, rest = key.removeprefix("blocks.").partition(".")
        for old, new in _BLOCK_KEYS:
            if rest.startswith(old):
                return f"layer.{index}.{new}{rest.removeprefix(old)}"
        return key
    for old, new in _MODEL_KEYS:
        if key.startswith(old):
            return new + key.removeprefix(old)
    return key
