"""Hugging Face transformers: ViT and the models on its layout (ViT-MSN, ViT-MAE's encoder, I-JEPA,
DeiT with its distillation token), DINOv2 (with and without registers), DINOv3 ViT, CLIP and
SigLIP vision towers, from safetensors or .bin files with their config.json and
preprocessor_config.json.

Every family is a pre-norm sequential ViT; a ``Layout`` names where it keeps each tensor, and one
builder reads them all. The family comes from config.json's ``model_type`` or, without one, from
the keys. Full two-tower checkpoints (CLIPModel, SiglipModel) give their vision tower; the text
tower is dropped by name, with a note, as is ViT-MAE's pixel decoder.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .config import ViTConfig
from .convert_common import (
    BIN_SHARD_INDEX,
    SHARD_INDEX,
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
    split_heads_in,
    split_heads_out,
    torch_linear,
    torch_norm,
)
from .convert_preprocess import SourcePreprocess
from .convert_side import HF_CONFIG, HF_PREPROCESSOR, read_side


@dataclass(frozen=True)
class Layout:
    """Where one family keeps its tensors; block names are relative to ``block`` ({i})."""

    block: str
    norm1: str
    norm2: str
    q: str
    k: str
    v: str
    o: str
    fc1: str
    fc2: str
    final_norm: str
    patch: str  # the patch conv's module
    eps: float  # transformers' default layer_norm_eps for the family
    act: str  # its default hidden_act
    cls: str | None = None
    pos: str | None = None  # [1, T, d] parameter, or an nn.Embedding's weight [T, d]
    registers: str | None = None
    pre_norm: str | None = None
    layer_scale: tuple[str, str] | None = None
    gate: str | None = None  # separate SwiGLU gate projection (DINOv3's gated MLP)
    # DINOv2's SwiGLU: weights_in = [gate | value] in one Linear, then weights_out
    fused_swiglu: tuple[str, str] | None = None

    def mlp_names(self, t: SourceTensors, b: str) -> tuple[str, str, bool]:
        """(first, second) MLP projections of block prefix ``b``, and whether it is gated."""
        if self.fused_swiglu and b + self.fused_swiglu[0] + ".weight" in t:
            return (*self.fused_swiglu, True)
        return self.fc1, self.fc2, bool(self.gate and b + self.gate + ".weight" in t)


_VIT_ATTENTION = dict(
    q="attention.attention.query",
    k="attention.attention.key",
    v="attention.attention.value",
    o="attention.output.dense",
)
_CLIP_BLOCK = dict(
    block="encoder.layers.{i}.",
    norm1="layer_norm1",
    norm2="layer_norm2",
    q="self_attn.q_proj",
    k="self_attn.k_proj",
    v="self_attn.v_proj",
    o="self_attn.out_proj",
    fc1="mlp.fc1",
    fc2="mlp.fc2",
    final_norm="post_layernorm",
    patch="embeddings.patch_embedding",
    pos="embeddings.position_embedding.weight",
)
_DINOV2 = Layout(
    block="encoder.layer.{i}.",
    norm1="norm1",
    norm2="norm2",
    **_VIT_ATTENTION,
    fc1="mlp.fc1",
    fc2="mlp.fc2",
    final_norm="layernorm",
    patch="embeddings.patch_embeddings.projection",
    cls="embeddings.cls_token",
    pos="embeddings.position_embeddings",
    layer_scale=("layer_scale1.lambda1", "layer_scale2.lambda1"),
    fused_swiglu=("mlp.weights_in", "mlp.weights_out"),
    eps=1e-6,
    act="gelu",
)
_VIT = Layout(
    block="encoder.layer.{i}.",
    norm1="layernorm_before",
    norm2="layernorm_after",
    **_VIT_ATTENTION,
    fc1="intermediate.dense",
    fc2="output.dense",
    final_norm="layernorm",
    patch="embeddings.patch_embeddings.projection",
    cls="embeddings.cls_token",
    pos="embeddings.position_embeddings",
    eps=1e-12,
    act="gelu",
)
LAYOUTS = {
    "vit": _VIT,
    # DeiT's distillation token follows the class token and has a row of the position table:
    # served as the model's one register token, whose table row it keeps
    "deit": Layout(**{**_VIT.__dict__, "registers": "embeddings.distillation_token"}),
    "dinov2": _DINOV2,
    "dinov2_with_registers": Layout(
        **{**_DINOV2.__dict__, "registers": "embeddings.register_tokens"}
    ),
    "dinov3_vit": Layout(
        block="layer.{i}.",
        norm1="norm1",
        norm2="norm2",
        q="attention.q_proj",
        k="attention.k_proj",
        v="attention.v_proj",
        o="attention.o_proj",
        fc1="mlp.up_proj",
        fc2="mlp.down_proj",
        gate="mlp.gate_proj",
        final_norm="norm",
        patch="embeddings.patch_embeddings",
        cls="embeddings.cls_token",
        registers="embeddings.register_tokens",
        layer_scale=("layer_scale1.lambda1", "layer_scale2.lambda1"),
        eps=1e-5,
        act="gelu",
    ),
    "clip_vision_model": Layout(
        **_CLIP_BLOCK,
        cls="embeddings.class_embedding",
        pre_norm="pre_layrnorm",
        eps=1e-5,
        act="quick_gelu",
    ),
    "siglip_vision_model": Layout(**_CLIP_BLOCK, eps=1e-6, act="gelu_pytorch_tanh"),
}
# config.json model_type -> layout (two-tower configs keep the vision one in vision_config; ViT-MSN,
# ViT-MAE and I-JEPA are ViT's modules under other names)
_MODEL_TYPES = {
    "clip": "clip_vision_model",
    "siglip": "siglip_vision_model",
    "vit_msn": "vit",
    "vit_mae": "vit",
    "ijepa": "vit",
}
_CLASSLESS = ("ijepa",)  # model types on ViT's layout with no class token
_EPS_OF_TYPE = {"vit_msn": 1e-6}  # a model type's default layer_norm_eps other than its layout's
# transformers' ACT2FN name -> (gelu_exact, mlp); gelu_python is the erf form in Python,
# gelu_fast, gelu_accurate and gelu_python_tanh the tanh form spelled otherwise
_ACTIVATIONS = {
    "gelu": (True, "gelu"),
    "gelu_python": (True, "gelu"),
    "gelu_new": (False, "gelu"),
    "gelu_pytorch_tanh": (False, "gelu"),
    "gelu_python_tanh": (False, "gelu"),
    "gelu_fast": (False, "gelu"),
    "gelu_accurate": (False, "gelu"),
    "quick_gelu": (True, "quick_gelu"),
}
# PIL's resampling filters by number, as preprocessor_config.json's resample gives them
_PIL_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
_PROJECTION = "visual_projection.weight"  # CLIPVisionModelWithProjection's [P, d]
# transformers 5 names the modules of ViT and DINOv2 differently in memory (state_dict()) than
# in hub files; these map the in-memory names to the hub names (DINOv3's hub names are its own)
_QKV = {"q": "query", "k": "key", "v": "value"}
_HF_RENAMES = (
    (
        r"^(?:encoder\.layer|layers)\.(\d+)\.attention\.([qkv])_proj\.",
        lambda m: f"encoder.layer.{m[1]}.attention.attention.{_QKV[m[2]]}.",
    ),
    (
        r"^(?:encoder\.layer|layers)\.(\d+)\.attention\.o_proj\.",
        r"encoder.layer.\1.attention.output.dense.",
    ),
    (r"^layers\.(\d+)\.mlp\.fc1\.", r"encoder.layer.\1.intermediate.dense."),
    (r"^layers\.(\d+)\.mlp\.fc2\.", r"encoder.layer.\1.output.dense."),
    (r"^layers\.(\d+)\.", r"encoder.layer.\1."),
    (r"^encoder\.layer\.(\d+)\.mlp\.down_proj\.", r"encoder.layer.\1.mlp.weights_out."),
    (r"^model\.layer\.(\d+)\.", r"layer.\1."),  # DINOv3ViTModel.model.layer
)
_DINOV2_GATE = re.compile(r"^(encoder\.layer\.\d+\.mlp\.)gate_proj\.(weight|bias)$")
# the other tower and the contrastive scalars of a two-tower checkpoint
_TEXT_TOWER = re.compile(r"^(text_model\.|text_projection\.|logit_scale$|logit_bias$)")
# the backbone's prefix in the task models read (ViTForImageClassification, ViTMAEForPreTraining,
# DeiTForImageClassificationWithTeacher, IJepaForImageClassification, Dinov2ForImageClassification,
# CLIPVisionModel, CLIPForImageClassification, ...)
_BACKBONE_PREFIX = re.compile(r"^(vit|deit|ijepa|dinov2|dinov2_with_registers|vision_model)\.")
# families whose task model's classifier reads another feature than the served pooled output:
# its logits cannot be served (the features are), so it is dropped, saying what it reads
_CLASSIFIER_READS = {
    "dinov2": "the class token and the patch tokens' mean, concatenated "
              "(Dinov2ForImageClassification)",
    "dinov2_with_registers": "the class token and the patch tokens' mean, concatenated "
                             "(Dinov2WithRegistersForImageClassification)",
    "clip_vision_model": "the mean of the patch tokens before post_layernorm "
                         "(CLIPForImageClassification)",
    "siglip_vision_model": "the mean of the final-normed tokens, not the attention-pooling "
                           "head's output (SiglipForImageClassification)",
}
_TEACHER_HEADS = tuple(f"{head}_classifier.{p}" for head in ("cls", "distillation")
                       for p in ("weight", "bias"))
_MAE_DECODER = "decoder."  # ViTMAEForPreTraining's pixel decoder: pre-training's alone


SIDE_FILES = ("config.json", "preprocessor_config.json")
# transformers' order: its single file, its shard index, then the pickle and its shard index
WEIGHT_FILES = ("model.safetensors", SHARD_INDEX, "pytorch_model.bin", BIN_SHARD_INDEX)


def side_files(path: Path) -> dict:
    """config.json (family, sizes, heads, epsilon, activation) and preprocessor_config.json."""
    side = read_side(path, "config.json", HF_CONFIG)
    if side.get("vision_config") is not None:  # a two-tower config: the image tower's part
        side = {**side["vision_config"], "projection_dim": side.get("projection_dim")}
    nulls: set[str] = set()
    side["_preprocessor"] = read_side(path, "preprocessor_config.json", HF_PREPROCESSOR, nulls)
    side["_preprocessor_nulls"] = nulls
    return side


def canonical(tensors: dict[str, np.ndarray], notes: list[str]) -> dict[str, np.ndarray]:
    text = {k for k in tensors if _TEXT_TOWER.match(k)}
    if text:
        notes.append(f"dropped the text tower and contrastive scalars ({len(text)} tensors)")
    decoder = {k for k in tensors if k.startswith(_MAE_DECODER)}
    if decoder:
        notes.append(f"dropped ViT-MAE's pixel decoder ({len(decoder)} tensors; pre-training's "
                     "reconstruction, not the encoder's features)")
    out = {}
    for key, value in tensors.items():
        if key in text or key in decoder:
            continue
        name = _BACKBONE_PREFIX.sub("", key, count=1)
        for pattern, repl in _HF_RENAMES:
            name, n = re.subn(pattern, repl, name)
            if n:
                break
        out[name] = value
    for key in [k for k in out if _DINOV2_GATE.match(k)]:  # in memory: gate and value apart
        m = _DINOV2_GATE.match(key)
        up = f"{m[1]}up_proj.{m[2]}"
        out[f"{m[1]}weights_in.{m[2]}"] = np.concatenate([out.pop(key), out.pop(up)])
    return out


# a backbone's prefix in a task model this converter does not read (refused with a hint)
_TASK_WRAPPERS = ("dinov3_vit.", "clip.", "siglip.")


def _family_of_keys(t: SourceTensors) -> str:
    if "layer.0.norm1.weight" in t:
        return "dinov3_vit"
    if "encoder.layer.0.norm1.weight" in t:
        return "dinov2_with_registers" if "embeddings.register_tokens" in t else "dinov2"
    if "encoder.layers.0.self_attn.q_proj.weight" in t:
        return "clip_vision_model" if "embeddings.class_embedding" in t else "siglip_vision_model"
    if "encoder.layer.0.layernorm_before.weight" in t:
        return "deit" if "embeddings.distillation_token" in t else "vit"
    wrapped = sorted({k.split(".")[0] for k in t.tensors if k.startswith(_TASK_WRAPPERS)})
    raise ConvertError(
        f"hf checkpoint: not a supported vision model (ViT, ViT-MSN, ViT-MAE, I-JEPA, DeiT, "
        f"DINOv2, DINOv3 ViT, CLIP or SigLIP vision tower); its keys begin: {t.some_keys()}"
        + (f" (a task model around {', '.join(wrapped)}, which this converter does not read; "
           "save and convert its backbone model alone)" if wrapped else "")
    )


def family(t: SourceTensors, side: dict) -> str:
    """The layout's name: what the keys show, which config.json's model_type must agree with."""
    from_keys = _family_of_keys(t)
    model_type = side.get("model_type")
    if model_type is None:
        return from_keys
    layout = _MODEL_TYPES.get(model_type, model_type)
    if layout not in LAYOUTS:
        known = ", ".join(sorted({*LAYOUTS, *_MODEL_TYPES} - {"clip", "siglip"}))
        raise ConvertError(
            f"hf checkpoint: config.json has model_type={model_type!r}, which is not supported "
            f"(supported: {known})"
        )
    if layout != from_keys:
        raise ConvertError(
            f"hf checkpoint: config.json says model_type={model_type!r}, but the weights are "
            f"laid out as {from_keys!r}"
        )
    return layout


def _image_size(side: dict) -> int | None:
    """config.json's ``image_size`` (an int, or [height, width]) as one side; None where it
    gives none. The model's grid is square: a non-square size is refused, not read as one."""
    size = side.get("image_size")  # its kind checked as the file was read (HF_CONFIG)
    if size is None:
        return None
    sides = size if isinstance(size, list) else [size, size]
    if sides[0] != sides[1]:
        raise ConvertError(f"hf checkpoint: config.json has image_size={size!r}, a non-square "
                           "input; only square patch grids are supported")
    return sides[0]


def _check_side(side: dict, cfg: ViTConfig) -> None:
    """config.json's sizes, where it gives them, must be the weights'."""
    swiglu = cfg.mlp == "swiglu" or side.get("use_swiglu_ffn")  # its intermediate_size is unused
    size = _image_size(side)
    weights = {
        "hidden_size": cfg.width,
        "num_hidden_layers": cfg.depth,
        "intermediate_size": None if swiglu else cfg.mlp_dim,
        "patch_size": cfg.patch,
        "num_register_tokens": cfg.num_registers,
        "projection_dim": cfg.projection_dim or None,
    }
    claims = {k: (side.get(k), v) for k, v in weights.items()}
    # the position table's grid; transformers crops a size that is not whole patches
    claims["image_size // patch_size"] = (None if size is None else size // cfg.patch, cfg.grid)
    check_claims("hf", "config.json", claims)


def infer_config(t: SourceTensors, hints: Hints, side: dict) -> ViTConfig:
    name = t.family = family(t, side)
    lay = LAYOUTS[name]
    width, channels, patch = patch_conv(t, lay.patch + ".weight")
    size = _image_size(side)  # a non-square one refused by name before the table is read
    depth = count_blocks(t, "^" + re.escape(lay.block).replace(r"\{i\}", r"(\d+)"))
    b = lay.block.format(i=0)
    model_type = side.get("model_type")
    # I-JEPA has none; so may a checkpoint without config.json, whose table then has no row for it
    class_token = lay.cls is not None and (lay.cls in t or model_type not in (None, *_CLASSLESS))
    covers_registers = name == "deit"
    if lay.pos is None:  # DINOv3: rotary; the grid is the config's image size
        grid = (size or 224) // patch
        covers_cls = False
    elif covers_registers:  # the class and distillation tokens' rows, then the grid's
        grid, covers_cls = grid_of(t.shape(lay.pos)[-2] - 1, True, t.source)
        if not covers_cls:
            raise ConvertError(f"hf checkpoint: {lay.pos} {t.shape(lay.pos)} has no rows for "
                               "DeiT's class and distillation tokens")
    else:
        grid, covers_cls = grid_of(t.shape(lay.pos)[-2], class_token, t.source)
    if model_type == "vit_mae" and side.get("mask_ratio"):
        t.notes.append(f"config.json's mask_ratio={side['mask_ratio']} hides patches in "
                       "pre-training only: every patch is served, in its place (ViTMAEModel with "
                       "mask_ratio 0 and the patches unshuffled)")
    if covers_registers:
        t.notes.append("DeiT's distillation token is served as the one register token; pooled is "
                       "the class token")
    act = side.get("hidden_act", lay.act)
    fc1, fc2, gated = lay.mlp_names(t, b)
    if gated:  # DINOv2's SwiGLU is silu whatever hidden_act says; DINOv3's uses hidden_act
        if lay.gate and act not in ("silu", "swish"):
            raise ConvertError(
                f"hf checkpoint: a gated MLP with hidden_act={act!r} (only silu, SwiGLU, is "
                "supported)"
            )
        gelu_exact, mlp = True, "swiglu"
        mlp_dim = t.shape(b + fc2 + ".weight")[1]
    else:
        if act not in _ACTIVATIONS:
            raise ConvertError(f"hf checkpoint: hidden_act={act!r} is not supported")
        gelu_exact, mlp = _ACTIVATIONS[act]
        mlp_dim = t.shape(b + lay.fc1 + ".weight")[0]
    eps = side.get("layer_norm_eps", _EPS_OF_TYPE.get(model_type, lay.eps))
    if "layer_norm_eps" not in side:
        missing = "config.json gives no layer_norm_eps" if model_type else "no config.json"
        t.notes.append(f"{missing}: LayerNorm epsilon {eps} ({model_type or name}'s default)")
    said = side.get("num_attention_heads")
    if hints.heads and said and hints.heads != said:
        raise ConvertError(f"hf checkpoint: --heads {hints.heads} contradicts config.json's "
                           f"num_attention_heads={said}")
    heads = infer_heads(t, hints, None, width, said)
    head = "cls" if class_token else "map" if "head.probe" in t else "gap"
    if head == "gap":
        t.notes.append(
            "no class token and no attention-pooling head: the pooled output is the mean of the "
            "final-normed patch tokens" + (" (as IJepaForImageClassification pools)"
                                           if model_type == "ijepa" else
                                           " (the source itself pools nothing)"))
    head_mlp = t.shape("head.mlp.fc1.weight")[0] if head == "map" else None
    sizes = Sizes(width, depth, heads, mlp_dim, patch, grid, channels, head_mlp)
    cfg = sizes.config(
        patch_bias=lay.patch + ".bias" in t,
        block="sequential",
        norm="layernorm",
        norm_eps=float(eps),
        qkv_bias=any(f"{b}{name}.bias" in t for name in (lay.q, lay.k, lay.v)),
        out_bias=b + lay.o + ".bias" in t,
        mlp_bias=b + fc2 + ".bias" in t,
        qk_norm=False,
        head=head,
        class_token=class_token,
        num_registers=t.shape(lay.registers)[1] if lay.registers and lay.registers in t else 0,
        posemb="rope" if lay.pos is None else "learn",
        # interpolate_pos_encoding: bicubic; antialiased in Dinov2WithRegistersModel only
        posemb_resample="bicubic_antialias" if name == "dinov2_with_registers" else "bicubic",
        rope_theta=float(side.get("rope_theta", 100.0)),
        posemb_covers_cls=covers_cls,
        posemb_covers_registers=covers_registers,
        pre_norm=lay.pre_norm is not None,
        gelu_exact=gelu_exact,
        mlp=mlp,
        projection_dim=t.shape(_PROJECTION)[0] if _PROJECTION in t else 0,
        num_classes=(t.shape("classifier.weight")[0]
                     if "classifier.weight" in t and name not in _CLASSIFIER_READS else 0),
    )
    _check_side(side, cfg)
    return cfg


@dataclass(frozen=True)
class _Processor:
    """What a transformers image processor class reads into a file's values: whether an int
    ``size`` is a square (its ``default_to_square``) and its defaults for what the file leaves
    out (transformers 5's class attributes)."""

    int_is_square: bool
    size: dict
    crop: bool
    crop_size: int | None
    resample: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


_HALF = (0.5, 0.5, 0.5)
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_IMAGENET_MEAN, _IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
_SQUARE_224 = {"height": 224, "width": 224}
_CLIP_PROCESSOR = _Processor(False, {"shortest_edge": 224}, True, 224, 3, _CLIP_MEAN, _CLIP_STD)
_PROCESSORS = {
    "ViT": _Processor(True, _SQUARE_224, False, None, 2, _HALF, _HALF),
    "DeiT": _Processor(True, {"height": 256, "width": 256}, True, 224, 3, _HALF, _HALF),
    "CLIP": _CLIP_PROCESSOR,
    "Bit": _CLIP_PROCESSOR,  # DINOv2's
    "Siglip": _Processor(False, _SQUARE_224, False, None, 3, _HALF, _HALF),
    "DINOv3ViT": _Processor(True, _SQUARE_224, False, None, 2, _IMAGENET_MEAN, _IMAGENET_STD),
}
# the class AutoImageProcessor takes for a model type when the file names none (transformers'
# mapping; the vision-tower types and DINOv2 with registers have no entry: their families')
_AUTO_PROCESSOR = {
    "vit": "ViT", "vit_msn": "ViT", "vit_mae": "ViT", "ijepa": "ViT", "deit": "DeiT",
    "dinov2": "Bit", "dinov2_with_registers": "Bit", "dinov3_vit": "DINOv3ViT",
    "clip": "CLIP", "clip_vision_model": "CLIP",
    "siglip": "Siglip", "siglip_vision_model": "Siglip",
}
_CLASS_SUFFIX = re.compile(r"(ImageProcessor|FeatureExtractor)(Fast|Pil)?$")


# a null in the file is None to transformers: these flags are then off; the other keys read
# here are values its processors fail on when they use them (refused when used)
_NULL_IS_OFF = ("do_resize", "do_center_crop", "do_rescale", "do_normalize", "default_to_square",
                "use_square_size")


def _processor_class(proc: dict, model_type: str | None) -> tuple[str, str | None]:
    """The processor class the file names (``image_processor_type``, or an older file's
    ``feature_extractor_type``), else the model type's: its name and its ``_PROCESSORS`` key
    (None: a class this converter does not know)."""
    named = proc.get("image_processor_type") or proc.get("feature_extractor_type")
    if named:
        family = _CLASS_SUFFIX.sub("", named)
        return named, family if family in _PROCESSORS else None
    family = _AUTO_PROCESSOR.get(model_type or "vit", "ViT")
    return f"{family}ImageProcessor", family


def preprocessing(side: dict, image_size: int) -> SourcePreprocess:
    """The image processor's geometry, resample and mean/std, as transformers reads them:
    ``size`` is a shortest edge, or a height x width every image is resized to (an int: a square
    or a shortest edge as the file's processor class reads one: CLIP's, DINOv2's and SigLIP's a
    shortest edge, ViT's, DeiT's and DINOv3's a square); ``crop_size`` applies when
    ``do_center_crop``; a square without a crop is served squashed (both sides resized); what
    the file leaves out is its class's default. Without preprocessor_config.json:
    ViTImageProcessor's defaults (both sides to the model's size, bilinear, mean/std 0.5)."""
    proc = side.get("_preprocessor") or {}
    if not proc:
        where = "hf defaults (no preprocessor_config.json)"
        return SourcePreprocess(
            where, False, image_size, image_size, "bilinear", _HALF, _HALF, squash=True,
            crop_offset="floor",  # served with a crop only under --resize: as transformers crops
        )
    where = "preprocessor_config.json"
    name, family = _processor_class(proc, side.get("model_type"))
    nulls = side.get("_preprocessor_nulls", set())
    proc = {**proc, **{k: False for k in nulls if k in _NULL_IS_OFF}}

    def value(key: str, default):
        if key in nulls:
            raise ConvertError(f"hf {where}: {key} is null, which {name} cannot preprocess with")
        return proc.get(key, default)

    cls = _PROCESSORS.get(family)
    if cls is None:  # its own steps (LeViT's crop_pct, a flipped channel order) are unknown
        known = ", ".join(f"{k}ImageProcessor" for k in _PROCESSORS)
        half = SourcePreprocess(where, True, image_size, image_size, "bilinear", _HALF, _HALF)
        return replace(half, unread=f"image processor {name!r} is not one this converter "
                                    f"reads ({known})")
    crops = bool(proc.get("do_center_crop", cls.crop))
    size = _size(value("size", cls.size), proc.get("default_to_square", cls.int_is_square), "size",
                 where) if proc.get("do_resize", True) else {"height": image_size}
    if family == "CLIP" and proc.get("use_square_size"):  # the class's own edge, as a square
        side_ = cls.size["shortest_edge"]
        size = {"height": side_, "width": side_}
    geometry, squash = None, False
    if "height" in size:  # a square: both sides resized (ViT, SigLIP, DINOv3; DeiT then crops)
        resize, squash = size["height"], True
    else:
        resize = size["shortest_edge"]
    crop = resize
    if crops:
        if value("crop_size", cls.crop_size) is None:
            raise ConvertError(f"hf {where}: do_center_crop with no crop_size ({name} has no "
                               "default crop)")
        crop = _size(value("crop_size", cls.crop_size), True, "crop_size", where)["height"]
    if not crops and not squash:
        geometry = f"resizes the shorter side to {resize} and does not crop (a non-square input)"
    if not proc.get("do_resize", True):
        geometry = "does not resize (do_resize false)"
    scale = value("rescale_factor", 1 / 255) if proc.get("do_rescale", True) else None
    if not proc.get("do_rescale", True) or abs(scale * 255 - 1) > 1e-6:
        raise ConvertError(
            f"hf {where}: do_rescale={proc.get('do_rescale', True)} rescale_factor={scale}: the "
            "pixel contract scales by 1/255"
        )
    normalise = proc.get("do_normalize", True)
    resample = value("resample", cls.resample)
    return SourcePreprocess(
        where,
        True,
        resize=resize,
        crop=crop,
        interpolation=_PIL_RESAMPLE.get(resample, str(resample)),
        mean=_per_channel(value("image_mean", cls.mean)) if normalise else (0.0, 0.0, 0.0),
        std=_per_channel(value("image_std", cls.std)) if normalise else (1.0, 1.0, 1.0),
        geometry=geometry,
        squash=squash,
        crop_offset="floor",  # transformers' center_crop floors (PIL and torchvision backends)
    )


def _size(value, square: bool, what: str, where: str) -> dict:
    """transformers' size dict: ``{"shortest_edge": n}`` or a square ``{"height", "width"}``."""
    if isinstance(value, int):
        return {"height": value, "width": value} if square else {"shortest_edge": value}
    value = value or {}
    if set(value) == {"shortest_edge"} or set(value) == {"height", "width"}:
        if value.get("height", 0) == value.get("width", 0):
            return {k: int(v) for k, v in value.items()}
    raise ConvertError(
        f"hf {where}: {what}={value!r} is not a shortest edge nor a square, which the pixel "
        "contract cannot serve"
    )


def _per_channel(value) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,) * 3


def _mlp(t: SourceTensors, b: str, lay: Layout, cfg: ViTConfig) -> dict:
    d, m, bias = cfg.width, cfg.mlp_dim, cfg.mlp_bias
    fc1, fc2, gated = lay.mlp_names(t, b)
    p = {}
    if gated and lay.gate is None:  # DINOv2: weights_in = [gate | value]
        w_in, b_in = torch_linear(t, b + fc1, 2 * m, d, bias)
        p["w_gate"], p["w_fc1"] = w_in[:, :m], w_in[:, m:]
        if bias:
            p["b_gate"], p["b_fc1"] = b_in[:m], b_in[m:]
    else:
        p["w_fc1"], p["b_fc1"] = torch_linear(t, b + fc1, m, d, bias)
        if gated:
            p["w_gate"], p["b_gate"] = torch_linear(t, b + lay.gate, m, d, bias)
    p["w_fc2"], p["b_fc2"] = torch_linear(t, b + fc2, d, m, bias)
    return {k: v for k, v in p.items() if v is not None}


def _block(t: SourceTensors, b: str, lay: Layout, cfg: ViTConfig) -> dict:
    d, h = cfg.width, cfg.heads
    block = {"norm1": torch_norm(t, b + lay.norm1, cfg), "norm2": torch_norm(t, b + lay.norm2, cfg)}
    qkv = [torch_linear(t, b + name, d, d, False)[0] for name in (lay.q, lay.k, lay.v)]
    block["w_qkv"] = np.concatenate([split_heads_in(w, h) for w in qkv], axis=-1)
    if cfg.qkv_bias:  # a projection without bias (DINOv3's key) adds zeros
        biases = [t.zeros(f"{b}{name}.bias", (d,), "a projection without bias")
                  for name in (lay.q, lay.k, lay.v)]
        block["b_qkv"] = np.concatenate([x.reshape(h, -1) for x in biases], axis=-1)
    w_o, b_o = torch_linear(t, b + lay.o, d, d, cfg.out_bias)
    block.update(_mlp(t, b, lay, cfg))
    if lay.layer_scale:
        fold_layer_scale(t, b + lay.layer_scale[0], d, w_o, b_o)
        fold_layer_scale(t, b + lay.layer_scale[1], d, block["w_fc2"], block.get("b_fc2"))
    block["w_o"] = split_heads_out(w_o, h)
    if b_o is not None:
        block["b_o"] = b_o
    return block


def _siglip_head(t: SourceTensors, cfg: ViTConfig) -> dict:
    """SiglipMultiheadAttentionPoolingHead: nn.MultiheadAttention (in_proj q|k|v), LN, MLP."""
    d, h, m = cfg.width, cfg.heads, cfg.map_mlp_dim
    w_in = t.take("head.attention.in_proj_weight", (3 * d, d)).T
    b_in = t.take("head.attention.in_proj_bias", (3 * d,))
    w_o, b_o = torch_linear(t, "head.attention.out_proj", d, d, True)
    w_fc1, b_fc1 = torch_linear(t, "head.mlp.fc1", m, d, True)
    w_fc2, b_fc2 = torch_linear(t, "head.mlp.fc2", d, m, True)
    return {
        "probe": t.take("head.probe", (1, 1, d)),
        "w_q": split_heads_in(w_in[:, :d], h),
        "b_q": b_in[:d].reshape(h, -1),
        "w_kv": fused_to_heads(w_in[:, d:], 2, h),
        "b_kv": fused_bias_to_heads(b_in[d:], 2, h),
        "w_o": split_heads_out(w_o, h),
        "b_o": b_o,
        "norm": torch_norm(t, "head.layernorm", cfg),
        "w_fc1": w_fc1,
        "b_fc1": b_fc1,
        "w_fc2": w_fc2,
        "b_fc2": b_fc2,
    }


def build_params(t: SourceTensors, cfg: ViTConfig) -> dict:
    lay = LAYOUTS[t.family]
    d, c, p = cfg.width, cfg.channels, cfg.patch
    params = {
        "patch_embed": patch_kernel(t.take(lay.patch + ".weight", (d, c, p, p))),
        "encoder_norm": torch_norm(t, lay.final_norm, cfg),
    }
    if cfg.patch_bias:
        params["patch_bias"] = t.take(lay.patch + ".bias", (d,))
    if cfg.posemb == "learn":
        n_pos = cfg.table_rows(cfg.table_grid)
        shape = (n_pos, d) if lay.pos.endswith(".weight") else (1, n_pos, d)
        params["pos_embedding"] = t.take(lay.pos, shape).reshape(1, n_pos, d)
    if cfg.class_token:
        shape = (d,) if lay.cls.endswith("class_embedding") else (1, 1, d)
        params["cls"] = t.take(lay.cls, shape).reshape(1, 1, d)
    if cfg.num_registers:
        params["registers"] = t.take(lay.registers, (1, cfg.num_registers, d))
    elif lay.registers:
        t.take(lay.registers, (1, 0, d))  # DINOv3 without registers keeps an empty tensor
    if cfg.pre_norm:
        params["pre_norm"] = torch_norm(t, lay.pre_norm, cfg)
    t.drop("embeddings.mask_token", "used only for masked image modelling")
    t.drop("embeddings.position_ids", "a buffer of the token indices")
    for i in range(cfg.depth):
        params[f"block_{i}"] = _block(t, lay.block.format(i=i), lay, cfg)
    for key in ("pooler.dense.weight", "pooler.dense.bias"):
        t.drop(key, "the tanh pooler is not the feature the source's classifier reads")
    for key in ("classifier.weight", "classifier.bias") if t.family in _CLASSIFIER_READS else ():
        t.drop(key, f"the classifier reads {_CLASSIFIER_READS[t.family]}, which is not the "
               "served pooled output: its logits are not served, the features are")
    for key in _TEACHER_HEADS:
        t.drop(key, "DeiT's two classifiers (logits: the mean of the class token's and the "
               "distillation token's) are not served; the features are")
    if cfg.head == "map":
        params["map_head"] = _siglip_head(t, cfg)
    if cfg.projection_dim:
        params["projection"] = t.take(_PROJECTION, (cfg.projection_dim, d)).T
    if cfg.num_classes:
        kernel, bias = torch_linear(t, "classifier", cfg.num_classes, d, True)
        params["classifier"], params["classifier_bias"] = kernel, bias
    return params
