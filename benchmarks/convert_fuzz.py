"""The converters against the peers' own model code at random shapes and options.

A hostile outside tester's run: each case draws a small config of a peer the converters accept
(timm's VisionTransformer, by its options or by a registered architecture name, its Eva models'
included; Hugging Face's ViTModel, Dinov2Model, Dinov2WithRegistersModel, DINOv3ViTModel,
SiglipVisionModel, CLIPVisionModel(WithProjection), and on ViT's layout ViT-MSN, ViT-MAE
(ViTMAEForPreTraining too), I-JEPA and DeiT with their task models; open_clip's CLIP), builds it
with its own
code, perturbs every parameter away from its init (tests/peers.py: a dropped bias, norm or
LayerScale shows), saves it as a user would (timm: safetensors and the config.json
``save_config_for_hf`` writes, or for a bare architecture sometimes the hub's kind without
model_args, with ``--heads``; Hugging Face: ``save_pretrained``; open_clip: its state dict beside
``open_clip_config.json``), converts it with ``model.convert`` as ``vit22b convert`` does (no
--model), and runs our forward in float32 against the peer's own on the same pixels: pooled,
last-layer patch tokens, register tokens and CLIP's pre-projection feature, each to
tests/parity.py's 1e-5 relative; at the model's own size, and for the peers that take other
sizes (Hugging Face's, timm's dynamic_img_size) also at a non-square grid one patch taller and
two wider, the position table resampled as the peer does.

Each case is one of:

- ``equal``: every output within 1e-5;
- ``refused``: a ConvertError naming an option the case varied (its name, or the words of what
  it does), or a key and what it is;
- ``WRONG``: converted, and an output differs (a silent wrong answer: the worst);
- ``crashed``: any other exception, or a ConvertError naming none of the case's options.

Configs the peer's own code rejects are drawn again (they are no case). Case ``i`` of a seed is
the same whatever ``--cases`` is, so ``--only i`` replays one.

    python benchmarks/convert_fuzz.py --cases 50 --seed 0
    python benchmarks/convert_fuzz.py --seed 0 --only 17 --verbose

The last line of stdout is one JSON object: counts by class and family, and every case not
``equal`` with its config and what happened.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import os
import random
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from vit22b.server.cpu_devices import prefer_wide_vectors  # noqa: E402  (jax-free)

prefer_wide_vectors()  # tests/conftest.py's XLA:CPU setup, before jax is imported
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # save_pretrained's, on stderr

import numpy as np  # noqa: E402
import torch  # noqa: E402
from parity import TOL_F32, compiled_apply  # noqa: E402
from peers import import_open_clip, import_timm, perturb, rel_err, vit_layout_outputs  # noqa: E402
from vit22b.model import OutputRequest  # noqa: E402
from vit22b.model.convert import ConvertError, Hints, convert  # noqa: E402

CLASSES = ("equal", "refused", "WRONG", "crashed")

# What a refusal may say for an option instead of its name.
OPTION_WORDS = {
    "img_size": ("square",),
    "image_size": ("square", "whole number"),
    "patch_size": ("square patches",),
    "global_pool": ("pool",),
    "fc_norm": ("fc_norm", "norm after average pooling"),
    "pool_include_prefix": ("pool_include_prefix",),
    "no_embed_class": ("no_embed_class", "covers the class"),
    "reg_tokens": ("register",),
    "final_norm": ("final norm",),
    "pos_embed": ("position embedding", "pos_embed"),
    "scale_attn_norm": ("norm inside attention",),
    "scale_mlp_norm": ("norm inside the mlp",),
    "embed_norm_layer": ("norm inside the patch embedding",),
    "attn_layer": ("differential",),
    "norm_layer": ("norm_layer",),
    "act_layer": ("act_layer",),
    "hidden_act": ("hidden_act",),
    "in_chans": ("channel",),
    "num_channels": ("channel",),
    "use_gated_mlp": ("gated",),
    "pool_type": ("pool_type",),
    "attentional_pool": ("attentional",),
    "pos_embed_type": ("position", "pos_embed_type"),
    "qk_norm": ("qk_norm", "qk-norm"),
    "scaled_cosine_attn": ("cosine",),
    "scale_heads": ("scale per head",),
    "scale_attn_inner": ("norm inside attention",),
    "scale_attn": ("norm after attention",),
    "scale_fc": ("norm inside the mlp", "scale_fc"),
    "norm_kwargs": ("norm_kwargs",),
    "act_kwargs": ("act_kwargs",),
    "vision_use_head": ("head",),
    # a flexible-size model is served at pretrained_cfg's input size, which timm's own
    # transforms give it
    "dynamic_img_size": ("pretrained_cfg",),
}
# what a refusal of one of timm's Eva models (eva.py: rotary embeddings) may name
EVA_WORDS = ("eva", "rotary", "pos_embed", "position embedding")


@dataclass
class Peer:
    """A peer saved to ``folder``, converted with ``--from source``; ``outputs(pixels)`` its own
    forward's tensors: 'pooled', 'patch_tokens' (last layer, after the final norm when
    ``normed``), 'register_tokens', 'pre_projection' (those it gives)."""

    source: str
    folder: Path
    outputs: Callable[[torch.Tensor], dict]
    normed: bool
    channels: int
    sizes: list[tuple[int, int]]  # pixel (height, width) compared at
    hints: Hints = Hints()  # what the command line needs for this file (--heads)


@dataclass
class Case:
    index: int
    family: str
    spec: dict  # what was drawn, as passed to the peer's code
    options: dict  # the options varied from the peer's defaults (refusals must name one)
    words: tuple[str, ...] = ()  # more that a refusal may name (an architecture's own arguments)
    result: str = ""
    detail: str = ""
    notes: list[str] = field(default_factory=list)


def _sizes(rng: random.Random, head_dims=(4, 8, 12, 16)) -> dict:
    heads = rng.randint(1, 4)
    return dict(heads=heads, width=heads * rng.choice(head_dims), depth=rng.randint(1, 3),
                patch=rng.choice((2, 3, 4, 5, 8)), rows=rng.randint(2, 5), cols=rng.randint(2, 5))


def _maybe(rng: random.Random, p: float, value, options: dict, name: str, spec: dict) -> None:
    """With probability ``p``, ``spec[name] = value`` (an option varied)."""
    if rng.random() < p:
        spec[name] = options[name] = value


# ------------------------------------------------------------------------------------------
# timm
# ------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _timm_architectures() -> dict[str, tuple[str, ...]]:
    """timm's registered VisionTransformer and Eva architectures and what a refusal of each may
    name: the model_args it passes itself (names and source text), read from
    vision_transformer.py and eva.py (a hub config.json does not record them), and for the Eva
    models their rotary embeddings."""
    timm = import_timm()
    found = {name: EVA_WORDS for name in timm.list_models(module="eva")}
    for module, extra in ((timm.models.eva, EVA_WORDS), (timm.models.vision_transformer, ())):
        for node in ast.parse(Path(module.__file__).read_text()).body:
            if not isinstance(node, ast.FunctionDef) or not any(
                getattr(d, "id", None) == "register_model" for d in node.decorator_list
            ):
                continue
            args = {}
            for inner in ast.walk(node):
                if (isinstance(inner, ast.Assign) and getattr(inner.targets[0], "id", "") ==
                        "model_args" and isinstance(inner.value, ast.Call)):
                    args = {kw.arg: ast.unparse(kw.value) for kw in inner.value.keywords
                            if kw.arg}
            found[node.name] = (*extra, *args, *(v.strip("'\"") for v in args.values()))
    return found


def sample_timm(rng: random.Random) -> tuple[dict, dict, tuple[str, ...]]:
    s = _sizes(rng)
    square = rng.random() > 0.15
    img = s["rows"] * s["patch"] if square else [s["rows"] * s["patch"], s["cols"] * s["patch"]]
    spec = dict(img_size=img, patch_size=s["patch"], embed_dim=s["width"], depth=s["depth"],
                num_heads=s["heads"], num_classes=rng.choice((0, 0, 0, 3)))
    options: dict = {} if square else {"img_size": img}
    words: tuple[str, ...] = ()
    if rng.random() < 0.3:  # a registered architecture: its own arguments come along unsaid
        spec["architecture"] = options["architecture"] = rng.choice(sorted(_timm_architectures()))
        words = _timm_architectures()[spec["architecture"]]
        spec["embed_dim"] = s["heads"] * rng.choice((8, 12, 16))  # DiffAttention halves heads
        _maybe(rng, 0.2, rng.choice((True, False)), options, "dynamic_img_size", spec)
        _maybe(rng, 0.2, rng.choice((2.0, 2.5, 34 / 13)), options, "mlp_ratio", spec)
        _maybe(rng, 0.2, round(rng.uniform(0.05, 1.0), 3), options, "init_values", spec)
        _maybe(rng, 0.15, rng.choice((True, False)), options, "qkv_bias", spec)
        _maybe(rng, 0.15, rng.randint(1, 3), options, "reg_tokens", spec)
        if len(options) == 1 and square and rng.random() < 0.4:
            # a hub file of a pretrained architecture: no model_args, --heads on the command line
            spec["hub_config"] = True
            words = (*words, "pretrained_cfg")  # its own preprocessing comes along (crop_mode)
        return spec, options, words
    spec["architecture"] = "vit_base_patch16_224"
    class_token = rng.random() > 0.25
    _maybe(rng, 1.0 if not class_token else 0.0, False, options, "class_token", spec)
    _maybe(rng, 0.3, rng.randint(1, 4), options, "reg_tokens", spec)
    _maybe(rng, 0.3, True, options, "no_embed_class", spec)
    pools = ("token", "avg", "map", "", "max", "avgmax", "prr")
    pool = rng.choices(pools, weights=(35, 25, 20, 6, 4, 4, 4))[0]
    if pool == "token" and not class_token:
        pool = "avg"
    _maybe(rng, 0.0 if pool == "token" else 1.0, pool, options, "global_pool", spec)
    _maybe(rng, 0.3, rng.choice((True, False)), options, "fc_norm", spec)
    _maybe(rng, 0.3, False, options, "qkv_bias", spec)
    _maybe(rng, 0.25, True, options, "qk_norm", spec)
    _maybe(rng, 0.15, False, options, "proj_bias", spec)
    _maybe(rng, 0.3, round(rng.uniform(0.05, 1.0), 3), options, "init_values", spec)
    _maybe(rng, 0.6, rng.choice((2.0, 2.5, 1.0, 34 / 13, 3.7362, 0.75)), options, "mlp_ratio",
           spec)
    _maybe(rng, 0.2, True, options, "pre_norm", spec)
    _maybe(rng, 0.2, True, options, "dynamic_img_size", spec)
    _maybe(rng, 0.4, rng.choice(("gelu", "gelu_tanh", "quick_gelu", "silu", "relu")), options,
           "act_layer", spec)
    _maybe(rng, 0.3, rng.choice(("layernorm", "rmsnorm", "simplenorm", "layernormfp32",
                                 "rmsnormfp32")), options, "norm_layer", spec)
    _maybe(rng, 0.05, False, options, "final_norm", spec)
    _maybe(rng, 0.03, "none", options, "pos_embed", spec)
    _maybe(rng, 0.05, True, options, "pool_include_prefix", spec)
    _maybe(rng, 0.05, True, options, "scale_attn_norm", spec)
    _maybe(rng, 0.05, True, options, "scale_mlp_norm", spec)
    _maybe(rng, 0.04, rng.choice(("layernorm", "rmsnorm")), options, "embed_norm_layer", spec)
    _maybe(rng, 0.04, rng.choice((1, 4)), options, "in_chans", spec)
    _maybe(rng, 0.04, [s["patch"], s["patch"] * 2], options, "patch_size", spec)
    if isinstance(spec["patch_size"], list):  # whole patches either way
        spec["img_size"] = [s["rows"] * s["patch"], s["cols"] * s["patch"] * 2]
    return spec, options, words


def build_timm(spec: dict, folder: Path, seed: int) -> Peer:
    from safetensors.torch import save_file

    timm = import_timm()
    from timm.models._hub import save_config_for_hf

    kwargs = {k: v for k, v in spec.items() if k not in ("architecture", "hub_config")}
    model = timm.create_model(spec["architecture"], pretrained=False, **kwargs).eval()
    perturb(model, seed=seed, scale=0.1)
    folder.mkdir()
    save_file(model.state_dict(), str(folder / "model.safetensors"))
    save_config_for_hf(model, str(folder / "config.json"))
    hints = Hints()
    if spec.get("hub_config"):  # as the hub keeps a pretrained model's: no model_args
        config = json.loads((folder / "config.json").read_text())
        del config["model_args"]
        (folder / "config.json").write_text(json.dumps(config))
        hints = Hints(heads=spec["num_heads"])
    height, width = _pair(spec["img_size"])
    sizes = [(height, width)]
    patch_h, patch_w = _pair(spec["patch_size"])
    if getattr(model, "dynamic_img_size", False):  # another grid: the table resampled
        sizes.append((height + patch_h, width + 2 * patch_w))

    def outputs(pixels):
        tokens = model.forward_features(pixels)
        prefix, n_cls = model.num_prefix_tokens, int(model.cls_token is not None)
        out = {"patch_tokens": tokens[:, prefix:]}
        pooled = model.forward_head(tokens, pre_logits=True)
        if pooled.ndim == 2:  # global_pool '' gives every token
            out["pooled"] = pooled
        if prefix > n_cls:
            out["register_tokens"] = tokens[:, n_cls:prefix]
        return out

    return Peer("timm", folder, outputs, True, spec.get("in_chans", 3), sizes, hints)


def _pair(size) -> tuple[int, int]:
    return tuple(size) if isinstance(size, (list, tuple)) else (size, size)


# ------------------------------------------------------------------------------------------
# Hugging Face transformers
# ------------------------------------------------------------------------------------------

HF_ACTS = ("gelu", "gelu_new", "quick_gelu", "gelu_pytorch_tanh", "relu", "silu", "gelu_fast",
           "gelu_python", "gelu_accurate", "gelu_10")
# family: (model classes, config class, defaults of hidden_act, layer_norm_eps)
HF_FAMILIES = {
    "hf-vit": (("ViTModel", "ViTForImageClassification"), "ViTConfig", "gelu", 1e-12),
    "hf-dinov2": (("Dinov2Model",), "Dinov2Config", "gelu", 1e-6),
    "hf-dinov2-reg": (("Dinov2WithRegistersModel",), "Dinov2WithRegistersConfig", "gelu", 1e-6),
    "hf-dinov3": (("DINOv3ViTModel",), "DINOv3ViTConfig", "gelu", 1e-5),
    "hf-siglip": (("SiglipVisionModel",), "SiglipVisionConfig", "gelu_pytorch_tanh", 1e-6),
    "hf-clip": (("CLIPVisionModel", "CLIPVisionModelWithProjection"), "CLIPVisionConfig",
                "quick_gelu", 1e-5),
    # on ViT's layout: their backbones and task models (a classifier, teacher heads, MAE's decoder)
    "hf-vit-msn": (("ViTMSNModel", "ViTMSNForImageClassification"), "ViTMSNConfig", "gelu", 1e-6),
    "hf-vit-mae": (("ViTMAEModel", "ViTMAEForPreTraining"), "ViTMAEConfig", "gelu", 1e-12),
    "hf-ijepa": (("IJepaModel", "IJepaForImageClassification"), "IJepaConfig", "gelu", 1e-12),
    "hf-deit": (("DeiTModel", "DeiTForImageClassification",
                 "DeiTForImageClassificationWithTeacher"), "DeiTConfig", "gelu", 1e-12),
}
_VIT_LAYOUT = ("hf-vit-msn", "hf-vit-mae", "hf-ijepa", "hf-deit")


def sample_hf(rng: random.Random, family: str) -> tuple[dict, dict, tuple[str, ...]]:
    classes, _, act, eps = HF_FAMILIES[family]
    s = _sizes(rng)
    size = s["rows"] * s["patch"]
    spec = dict(model=rng.choice(classes), hidden_size=s["width"], num_hidden_layers=s["depth"],
                num_attention_heads=s["heads"], patch_size=s["patch"], image_size=size)
    options: dict = {}
    _maybe(rng, 0.08, size + rng.randint(1, s["patch"] - 1), options, "image_size", spec)
    _maybe(rng, 0.05, [size, s["cols"] * s["patch"]], options, "image_size", spec)
    _maybe(rng, 0.04, [s["patch"], s["patch"] + 1], options, "patch_size", spec)
    _maybe(rng, 0.5, rng.choice([a for a in HF_ACTS if a != act]), options, "hidden_act", spec)
    _maybe(rng, 0.5, rng.choice([e for e in (1e-12, 1e-6, 1e-5, 1e-3, 0.1) if e != eps]),
           options, "layer_norm_eps", spec)
    _maybe(rng, 0.04, rng.choice((1, 4)), options, "num_channels", spec)
    if family in ("hf-vit", "hf-siglip", "hf-clip", "hf-dinov3", *_VIT_LAYOUT):
        spec["intermediate_size"] = rng.randint(4, 4 * s["width"])
    if family in ("hf-vit", "hf-dinov2", "hf-dinov2-reg", *_VIT_LAYOUT):
        _maybe(rng, 0.3, False, options, "qkv_bias", spec)
    if family in ("hf-dinov2", "hf-dinov2-reg"):
        _maybe(rng, 0.5, rng.choice((2, 2.5, 1.3, 3)), options, "mlp_ratio", spec)
        _maybe(rng, 0.3, True, options, "use_swiglu_ffn", spec)
    if family in ("hf-dinov2", "hf-dinov2-reg", "hf-dinov3"):
        _maybe(rng, 0.5, round(rng.uniform(0.05, 1.0), 3), options, "layerscale_value", spec)
    if family == "hf-dinov2-reg":
        spec["num_register_tokens"] = rng.randint(0, 4)
    if family == "hf-dinov3":
        spec["num_register_tokens"] = rng.randint(0, 4)
        for name in ("query_bias", "key_bias", "value_bias", "proj_bias", "mlp_bias"):
            _maybe(rng, 0.2, rng.choice((True, False)), options, name, spec)
        _maybe(rng, 0.3, rng.choice((50.0, 1000.0)), options, "rope_theta", spec)
        if rng.random() < 0.3:
            spec["use_gated_mlp"] = options["use_gated_mlp"] = True
            if rng.random() < 0.7:
                spec["hidden_act"] = options["hidden_act"] = "silu"
    if family == "hf-siglip":
        _maybe(rng, 0.2, False, options, "vision_use_head", spec)
    if spec["model"] == "CLIPVisionModelWithProjection":
        spec["projection_dim"] = rng.randint(4, 40)
    if spec["model"].endswith(("ForImageClassification", "WithTeacher")):
        spec["num_labels"] = 3
    if spec["model"] == "ViTMAEForPreTraining":
        spec.update(decoder_hidden_size=16, decoder_num_hidden_layers=1,
                    decoder_num_attention_heads=2, decoder_intermediate_size=24)
    if family == "hf-vit-mae":  # pre-training's masking: every patch is served whatever it says
        _maybe(rng, 0.5, rng.choice((0.0, 0.75)), options, "mask_ratio", spec)
    return spec, options, ()


def build_hf(spec: dict, folder: Path, seed: int, family: str) -> Peer:
    import transformers

    config_cls = getattr(transformers, HF_FAMILIES[family][1])
    config = config_cls(**{k: v for k, v in spec.items() if k != "model"})
    model = getattr(transformers, spec["model"])(config).eval()
    perturb(model, seed=seed, scale=0.1)
    model.save_pretrained(folder)
    height, width = _pair(spec["image_size"])
    patch_h, patch_w = _pair(spec["patch_size"])
    normed = family != "hf-clip"  # CLIP's last_hidden_state is before post_layernorm
    registers = spec.get("num_register_tokens", 0)
    # another grid too: the learned table resampled as transformers does (DINOv2 always does;
    # ViT, CLIP and SigLIP when asked), DINOv3's rotary embedding at that grid
    resample = {"interpolate_pos_encoding": True} if family in ("hf-vit", "hf-clip",
                                                                "hf-siglip") else {}

    def outputs(pixels):
        if family in _VIT_LAYOUT:  # the backbone alone, unmasked (ViT-MAE)
            model.config.mask_ratio = 0.0  # the backbone's config too (one object)
            backbone = next((getattr(model, name) for name in ("vit", "deit", "ijepa")
                             if hasattr(model, name)), model)
            return vit_layout_outputs(backbone, pixels, interpolate=True)
        if spec["model"] == "ViTForImageClassification":
            hidden = model.vit(pixel_values=pixels, **resample).last_hidden_state
            return {"pooled": hidden[:, 0], "patch_tokens": hidden[:, 1:]}
        out = model(pixel_values=pixels, **resample)
        hidden = out.last_hidden_state
        if family == "hf-vit":
            return {"pooled": hidden[:, 0], "patch_tokens": hidden[:, 1:]}
        if family == "hf-siglip":
            peer = {"patch_tokens": hidden}
            if out.pooler_output is not None:
                peer["pooled"] = out.pooler_output
            return peer
        if family == "hf-clip":
            if hasattr(out, "image_embeds"):
                inner = model.vision_model(pixel_values=pixels, **resample).pooler_output
                return {"pooled": out.image_embeds, "pre_projection": inner,
                        "patch_tokens": hidden[:, 1:]}
            return {"pooled": out.pooler_output, "patch_tokens": hidden[:, 1:]}
        peer = {"pooled": out.pooler_output, "patch_tokens": hidden[:, 1 + registers:]}
        if registers:
            peer["register_tokens"] = hidden[:, 1:1 + registers]
        return peer

    sizes = [(height, width), (height + patch_h, width + 2 * patch_w)]
    return Peer("hf", folder, outputs, normed, spec.get("num_channels", 3), sizes)


# ------------------------------------------------------------------------------------------
# open_clip
# ------------------------------------------------------------------------------------------


def sample_open_clip(rng: random.Random) -> tuple[dict, dict, tuple[str, ...]]:
    s = _sizes(rng)
    size = s["rows"] * s["patch"]
    vision = dict(image_size=size, layers=s["depth"], width=s["width"],
                  head_width=s["width"] // s["heads"], patch_size=s["patch"])
    options: dict = {}
    _maybe(rng, 0.05, size + 1, options, "image_size", vision)
    _maybe(rng, 0.05, [size, s["cols"] * s["patch"]], options, "image_size", vision)
    _maybe(rng, 0.5, rng.choice((2.0, 2.5, 1.0, 3.7362)), options, "mlp_ratio", vision)
    _maybe(rng, 0.3, rng.choice((0.1, 0.5)), options, "ls_init_value", vision)
    _maybe(rng, 0.2, True, options, "no_ln_pre", vision)
    _maybe(rng, 0.15, True, options, "final_ln_after_pool", vision)
    _maybe(rng, 0.15, rng.choice(("avg", "none")), options, "pool_type", vision)
    _maybe(rng, 0.1, "sin_cos_2d", options, "pos_embed_type", vision)
    _maybe(rng, 0.15, {"eps": rng.choice((1e-3, 1e-6))}, options, "norm_kwargs", vision)
    _maybe(rng, 0.15, {"approximate": "tanh"}, options, "act_kwargs", vision)
    for name in ("qk_norm", "scaled_cosine_attn", "scale_heads", "scale_attn_inner",
                 "scale_attn", "scale_fc", "attentional_pool"):
        _maybe(rng, 0.04, True, options, name, vision)
    if vision.get("attentional_pool"):
        vision.update(attn_pooler_queries=4, attn_pooler_heads=1)
    spec = {"embed_dim": rng.randint(4, 32), "quick_gelu": rng.random() < 0.5,
            "vision_cfg": vision,
            "text_cfg": dict(context_length=4, vocab_size=20, width=8, heads=1, layers=1)}
    return spec, options, ()


def build_open_clip(spec: dict, folder: Path, seed: int) -> Peer:
    open_clip = import_open_clip()
    model = open_clip.model.CLIP(**spec).eval()
    perturb(model, seed=seed, scale=0.1)
    folder.mkdir()
    torch.save(model.state_dict(), folder / "open_clip_pytorch_model.bin")
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": spec}))
    model.visual.output_tokens = True
    vision = spec["vision_cfg"]

    def outputs(pixels):
        pooled, tokens = model.visual(pixels)
        return {"pooled": pooled, "patch_tokens": tokens}

    normed = not vision.get("final_ln_after_pool")
    return Peer("open_clip", folder, outputs, normed, 3, [_pair(vision["image_size"])])


# ------------------------------------------------------------------------------------------
# one case
# ------------------------------------------------------------------------------------------

FAMILIES = {"timm": 40, **{name: 8 for name in HF_FAMILIES}, "open_clip": 12}


def draw(index: int, seed: int, folder: Path) -> tuple[Case, Peer]:
    """Case ``index`` of ``seed``: drawn again until the peer's own code builds it."""
    rng = random.Random(f"{seed}-{index}")
    torch.manual_seed(rng.getrandbits(32))  # the peers' own init, the same on a replay
    family = rng.choices(list(FAMILIES), weights=list(FAMILIES.values()))[0]
    for attempt in range(50):
        if family == "timm":
            spec, options, words = sample_timm(rng)
            build = functools.partial(build_timm, spec)
        elif family == "open_clip":
            spec, options, words = sample_open_clip(rng)
            build = functools.partial(build_open_clip, spec)
        else:
            spec, options, words = sample_hf(rng, family)
            build = functools.partial(build_hf, spec, family=family)
        where = folder / f"case{index}-{attempt}"
        try:
            peer = build(where, seed=index)
            with torch.no_grad():  # the peer runs at its own sizes
                for height, width in peer.sizes:
                    peer.outputs(torch.zeros(1, peer.channels, height, width))
        except Exception:  # the peer's own code rejects this config: not a case
            continue
        return Case(index, family, spec, options, words), peer
    raise RuntimeError(f"case {index}: no config the peer builds in 50 draws")


def named(index: int, architecture: str, folder: Path) -> tuple[Case, Peer]:
    """timm's registered ``architecture`` at one small shape (``--architectures``)."""
    torch.manual_seed(index)
    spec = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=0,
                architecture=architecture)
    words = _timm_architectures().get(architecture, ())
    peer = build_timm(spec, folder / f"case{index}", seed=index)
    return Case(index, "timm", spec, {"architecture": architecture}, words), peer


def names_an_option(message: str, case: Case) -> bool:
    """Whether a refusal names one of the options the case varied, or a key and what it is
    (``SourceTensors.refuse``'s words)."""
    if "which this model cannot express" in message:
        return True
    text = message.lower().replace(str(case.spec.get("architecture", "\0")).lower(), "")
    words = [*case.options, *case.words]
    for name in (*case.options, *case.words):  # an architecture's own arguments count too
        words += OPTION_WORDS.get(name, ())
    return any(word.lower() in text for word in words if word and word != "architecture")


def compare(converted, peer: Peer, seed: int) -> dict[str, float]:
    """{output@size: relative error of ours against the peer's}."""
    cfg = converted.config.replace(compute_dtype="float32")
    errors = {}
    for height, width in peer.sizes:
        gen = torch.Generator().manual_seed(seed)
        pixels = torch.randn(2, peer.channels, height, width, generator=gen)
        with torch.no_grad():
            ref = {k: v.numpy() for k, v in peer.outputs(pixels).items()}
        request = OutputRequest(
            pooled="pooled" in ref,
            patch_layers=(-1,),
            norm_patches=peer.normed,
            register_tokens="register_tokens" in ref,
            pre_projection="pre_projection" in ref,
        )
        # a size that is not whole patches: the peer's convolution drops the rest
        rows, cols = height // cfg.patch * cfg.patch, width // cfg.patch * cfg.patch
        nhwc = pixels[:, :, :rows, :cols].permute(0, 2, 3, 1).numpy()
        ours = compiled_apply(cfg, converted.params, nhwc, request)
        ours = {**ours, "patch_tokens": ours["patch_tokens"][cfg.depth - 1]}
        for name, value in ref.items():
            got = np.asarray(ours[name])
            key = f"{name}@{height}x{width}"
            errors[key] = rel_err(got, value) if got.shape == value.shape else float("inf")
    return errors


def run_case(case: Case, peer: Peer, verbose: bool) -> None:
    try:
        converted = convert(peer.source, peer.folder, peer.hints)
    except ConvertError as err:
        case.result = "refused" if names_an_option(str(err), case) else "crashed"
        case.detail = f"ConvertError: {err}"
    except Exception as err:
        case.result, case.detail = "crashed", f"{type(err).__name__}: {err}"
        if verbose:
            traceback.print_exc()
    else:
        case.notes = converted.notes
        try:
            errors = compare(converted, peer, case.index)
        except Exception as err:
            case.result, case.detail = "crashed", f"our forward: {type(err).__name__}: {err}"
            if verbose:
                traceback.print_exc()
        else:
            worst = max(errors, key=errors.get)
            case.result = "equal" if errors[worst] < TOL_F32 else "WRONG"
            case.detail = f"worst {worst} {errors[worst]:.1e}"


def _short(case: Case) -> str:
    spec = dict(case.spec)
    if case.family == "open_clip":
        spec = {**spec.pop("vision_cfg"), "quick_gelu": spec["quick_gelu"]}
    return ", ".join(f"{k}={v}" for k, v in spec.items() if k != "text_cfg")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", type=int, nargs="*", help="replay these case indices")
    parser.add_argument("--verbose", action="store_true", help="tracebacks and notes")
    parser.add_argument("--architectures", nargs="+", metavar="NAME",
                        help="instead of random cases: these registered timm architectures, "
                        "each at one small shape")
    args = parser.parse_args()
    indices = range(len(args.architectures)) if args.architectures else (
        args.only if args.only else range(args.cases))
    cases = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        print("| # | family | class | detail | config |")
        print("|---|---|---|---|---|")
        for index in indices:
            if args.architectures:
                case, peer = named(index, args.architectures[index], Path(tmp))
            else:
                case, peer = draw(index, args.seed, Path(tmp))
            run_case(case, peer, args.verbose)
            cases.append(case)
            detail = case.detail.replace("\n", " ")[:300]
            print(f"| {index} | {case.family} | {case.result} | {detail} | {_short(case)} |",
                  flush=True)
            if args.verbose and case.notes:
                print("   notes: " + " / ".join(case.notes))
    counts = Counter(case.result for case in cases)
    by_family: dict[str, Counter] = {}
    for case in cases:
        by_family.setdefault(case.family, Counter())[case.result] += 1
    summary = {
        "seed": args.seed,
        "cases": len(cases),
        "seconds": round(time.perf_counter() - start, 1),
        "counts": {name: counts.get(name, 0) for name in CLASSES},
        "by_family": {name: dict(c) for name, c in sorted(by_family.items())},
        "not_equal": [
            {"case": c.index, "family": c.family, "class": c.result, "detail": c.detail,
             "options": c.options, "spec": c.spec}
            for c in cases if c.result != "equal"
        ],
    }
    print(json.dumps(summary, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
