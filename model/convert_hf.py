"""Hugging Face transformers: ViTModel and ViTForImageClassification safetensors or .bin files."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from .config import Preprocess, ViTConfig
from .convert_common import (
    ConvertError,
    Hints,
    Sizes,
    SourceTensors,
    count_blocks,
    grid_of,
    infer_heads,
    json_beside,
    patch_kernel,
    split_heads_in,
    split_heads_out,
    torch_linear,
    torch_norm,
)

# transformers 5 names its modules differently in memory; hub files use the classic names.
_HF_RENAMES = (
    (r"^layers\.(\d+)\.attention\.q_proj\.", r"encoder.layer.\1.attention.attention.query."),
    (r"^layers\.(\d+)\.attention\.k_proj\.", r"encoder.layer.\1.attention.attention.key."),
    (r"^layers\.(\d+)\.attention\.v_proj\.", r"encoder.layer.\1.attention.attention.value."),
    (r"^layers\.(\d+)\.attention\.o_proj\.", r"encoder.layer.\1.attention.output.dense."),
    (r"^layers\.(\d+)\.mlp\.fc1\.", r"encoder.layer.\1.intermediate.dense."),
    (r"^layers\.(\d+)\.mlp\.fc2\.", r"encoder.layer.\1.output.dense."),
    (r"^layers\.(\d+)\.", r"encoder.layer.\1."),
)
_HF_ACTIVATIONS = {"gelu": True, "gelu_new": False, "gelu_pytorch_tanh": False}
_PIL_RESAMPLE = {2: "bilinear", 3: "bicubic"}


def side_files(path: Path) -> tuple[dict, bool]:
    """config.json (sizes, heads, epsilon, activation) and preprocessor_config.json."""
    side = json_beside(path, "config.json")
    side["_preprocessor"] = json_beside(path, "preprocessor_config.json")
    return side, bool(side["_preprocessor"])


def canonical(tensors: dict[str, np.ndarray], notes: list[str]) -> dict[str, np.ndarray]:
    out = {}
    for key, value in tensors.items():
        name = key.removeprefix("vit.")
        for pattern, repl in _HF_RENAMES:
            name, n = re.subn(pattern, repl, name)
            if n:
                break
        out[name] = value
    return out


def infer_config(t: SourceTensors, hints: Hints, side: dict) -> ViTConfig:
    width, channels, patch, _ = t.shape("embeddings.patch_embeddings.projection.weight")
    depth = count_blocks(t, r"encoder\.layer\.(\d+)\.")
    grid, covers_cls = grid_of(t.shape("embeddings.position_embeddings")[1], True)
    act = side.get("hidden_act", "gelu")
    if act not in _HF_ACTIVATIONS:
        raise ConvertError(f"hf checkpoint: hidden_act={act!r} is not supported")
    if "layer_norm_eps" not in side:
        t.notes.append("no config.json: LayerNorm epsilon 1e-12 (Hugging Face's default)")
    b = "encoder.layer.0."
    heads = infer_heads(t, hints, None, width, side.get("num_attention_heads"))
    mlp_dim = t.shape(b + "intermediate.dense.weight")[0]
    sizes = Sizes(width, depth, heads, mlp_dim, patch, grid, channels)
    return sizes.config(
        block="sequential",
        norm="layernorm",
        norm_eps=float(side.get("layer_norm_eps", 1e-12)),
        qkv_bias=b + "attention.attention.query.bias" in t,
        out_bias=True,
        mlp_bias=True,
        qk_norm=False,
        head="cls",
        class_token=True,
        posemb_covers_cls=covers_cls,
        gelu_exact=_HF_ACTIVATIONS[act],
        num_classes=t.shape("classifier.weight")[0] if "classifier.weight" in t else 0,
        preprocess=_hf_preprocess(side.get("_preprocessor", {}), grid * patch),
    )


def _hf_preprocess(proc: dict, image_size: int) -> Preprocess:
    # ViTImageProcessor: resize straight to the model's size (no crop), bilinear, mean/std 0.5.
    return Preprocess(
        resize=image_size,
        interpolation=_PIL_RESAMPLE.get(int(proc.get("resample", 2)), "bilinear"),
        mean=tuple(proc.get("image_mean", (0.5, 0.5, 0.5))),
        std=tuple(proc.get("image_std", (0.5, 0.5, 0.5))),
    )


def build_params(t: SourceTensors, cfg: ViTConfig) -> dict:
    d, h, c, p, mlp = cfg.width, cfg.heads, cfg.channels, cfg.patch, cfg.mlp_dim
    e = "embeddings."
    params = {
        "patch_embed": patch_kernel(t.take(e + "patch_embeddings.projection.weight", (d, c, p, p))),
        "patch_bias": t.take(e + "patch_embeddings.projection.bias", (d,)),
        "cls": t.take(e + "cls_token", (1, 1, d)),
        "pos_embedding": t.take(e + "position_embeddings", (1, cfg.num_patches + 1, d)),
        "encoder_norm": torch_norm(t, "layernorm", cfg),
    }
    t.drop(e + "mask_token", "used only for masked image modelling")
    for i in range(cfg.depth):
        b = f"encoder.layer.{i}."
        a = b + "attention.attention."
        qkv = [torch_linear(t, a + n, d, d, cfg.qkv_bias) for n in ("query", "key", "value")]
        block = {
            "norm1": torch_norm(t, b + "layernorm_before", cfg),
            "norm2": torch_norm(t, b + "layernorm_after", cfg),
            "w_qkv": np.concatenate([split_heads_in(w, h) for w, _ in qkv], axis=-1),
        }
        if cfg.qkv_bias:
            block["b_qkv"] = np.concatenate([bias.reshape(h, -1) for _, bias in qkv], axis=-1)
        w_o, block["b_o"] = torch_linear(t, b + "attention.output.dense", d, d, True)
        block["w_o"] = split_heads_out(w_o, h)
        block["w_fc1"], block["b_fc1"] = torch_linear(t, b + "intermediate.dense", mlp, d, True)
        block["w_fc2"], block["b_fc2"] = torch_linear(t, b + "output.dense", d, mlp, True)
        params[f"block_{i}"] = block
    for key in ("pooler.dense.weight", "pooler.dense.bias"):
        t.drop(key, "the tanh pooler is not the feature a classifier reads (the CLS token is)")
    if cfg.num_classes:
        kernel, bias = torch_linear(t, "classifier", cfg.num_classes, d, True)
        params["classifier"], params["classifier_bias"] = kernel, bias
    return params
