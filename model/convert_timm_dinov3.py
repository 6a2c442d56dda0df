"""timm's DINOv3 port (eva.py's ``vit_*_dinov3*``): the Hugging Face DINOv3 model under timm's
names, read by renaming its tensors to transformers' ``DINOv3ViTModel`` layout and converting
that (``convert_hf``), so one set of rules reads both releases of the same weights.

What timm's config changes without changing the weights' names is checked here: the rotary
embedding (``rope_type='dinov3'`` with rotate-half pairs, base ``rope_temperature``), the MLP's
activation, and the pooled output (timm's default for these models averages the patch tokens;
``global_pool='token'`` is the class token, as upstream and transformers pool).
"""

from __future__ import annotations

from . import convert_hf
from .config import ViTConfig
from .convert_common import ConvertError, Hints, SourceTensors

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
    for key, what in (
        ("blocks.0.attn.norm.weight", "a norm inside attention (timm scale_attn_inner)"),
        ("blocks.0.mlp.norm.weight", "a norm inside the MLP (timm scale_mlp)"),
        ("fc_norm.weight", "a norm after pooling (timm use_fc_norm)"),
        ("pos_embed", "an absolute position table beside the rotary embedding"),
    ):
        t.refuse(key, what)
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


def _refuse(t: SourceTensors, args: dict) -> None:
    """What timm's config changes in the numbers and the weights do not show."""
    rope = args.get("rope_type", "dinov3")
    if rope != "dinov3":
        raise ConvertError(f"{t.source} checkpoint: rope_type={rope!r} is not supported (only "
                           "DINOv3's, 'dinov3')")
    if args.get("rope_rotate_half") is False:
        raise ConvertError(f"{t.source} checkpoint: rope_rotate_half=False (interleaved rotary "
                           "pairs) is not supported: DINOv3 rotates halves")
    if args.get("use_abs_pos_emb"):
        raise ConvertError(f"{t.source} checkpoint: use_abs_pos_emb=True (a position table "
                           "beside the rotary embedding) is not supported")


def _registered_heads(side: dict) -> int | None:
    """The heads the architecture's registration passes (vit_{size}_patch16_dinov3[_qkvb])."""
    name = str(side.get("architecture", "")).removeprefix("vit_")
    size = name.split("_patch", 1)[0]
    return _HEADS.get(size) if name.endswith(("_dinov3", "_dinov3_qkvb")) else None


def _renamed(t: SourceTensors) -> dict:
    """``t``'s tensors under transformers' DINOv3 names; the fused qkv split in three."""
    out = {}
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
