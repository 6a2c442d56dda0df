"""The config files beside a checkpoint's weights, checked for what the converters read.

The converters read a few keys of timm's config.json, Hugging Face's config.json and
preprocessor_config.json, and open_clip_config.json. Each key read has one kind here (a
positive integer, a finite number, a string, a flag, a list, an object of further keys:
``schema``); a file whose value is of another kind is refused naming the file, the key and the
value before any converter reads it. A key that is null is read as absent, the source's default;
a reader that must tell a null apart (transformers' processors keep a null as None: a flag
off, a value they fail on) asks for the null keys. Keys not listed are not read, and not checked
(the files hold many more).
"""

from __future__ import annotations

from pathlib import Path

from .convert_common import ConvertError, read_json
from .schema import COUNT, FLAG, NUMBER, POSITIVE, SIZE, TEXT, Kind, Schema, check, either, list_of


def read_side(path: Path, name: str, schema: Schema, nulls: set[str] | None = None) -> dict:
    """The JSON file ``name`` beside the weights at ``path`` ({} when there is none), checked;
    its top-level keys that are null are added to ``nulls``."""
    file = (path if path.is_dir() else path.parent) / name
    if not file.exists():
        return {}
    raw = read_json(file)
    if nulls is not None and isinstance(raw, dict):
        nulls.update(k for k, v in raw.items() if v is None)
    data = _without_nulls(raw)
    check(data, schema, str(file), ConvertError)
    return data


def _without_nulls(data: object) -> object:
    if isinstance(data, dict):
        return {k: _without_nulls(v) for k, v in data.items() if v is not None}
    return data


SQUARE = either(SIZE, list_of(SIZE, 2))  # a size: one side, or [height, width]

TIMM_CONFIG: Schema = {
    "architecture": TEXT,
    "num_classes": COUNT,
    "global_pool": TEXT,
    "model_args": {
        "num_heads": SIZE,
        "embed_dim": SIZE,
        "depth": SIZE,
        "num_classes": COUNT,
        "patch_size": SQUARE,
        "img_size": SQUARE,
        "pool_include_prefix": FLAG,
        "no_embed_class": FLAG,
        "use_rot_pos_emb": FLAG,
        "act_layer": TEXT,
        "norm_layer": TEXT,
        "mlp_layer": TEXT,
        "block_fn": TEXT,
        "global_pool": TEXT,
        "rope_type": TEXT,  # eva.py's DINOv3 port (convert_timm_dinov3)
        "rope_temperature": POSITIVE,
        "rope_rotate_half": FLAG,
        "use_abs_pos_emb": FLAG,
    },
    "pretrained_cfg": {
        "input_size": list_of(SIZE, 3),
        "crop_pct": POSITIVE,
        "crop_mode": TEXT,
        "interpolation": TEXT,
        "mean": list_of(NUMBER),
        "std": list_of(NUMBER),
    },
}

_HF_VISION: Schema = {
    "model_type": TEXT,
    "hidden_size": SIZE,
    "num_hidden_layers": SIZE,
    "intermediate_size": SIZE,
    "num_attention_heads": SIZE,
    "patch_size": SIZE,
    "image_size": SQUARE,
    "num_register_tokens": COUNT,
    "projection_dim": SIZE,
    "use_swiglu_ffn": FLAG,
    "hidden_act": TEXT,
    "layer_norm_eps": POSITIVE,
    "rope_theta": POSITIVE,
    "mask_ratio": NUMBER,  # ViT-MAE's pre-training masking (a note: every patch is served)
}
HF_CONFIG: Schema = {**_HF_VISION, "vision_config": _HF_VISION}

# transformers' size: one side, or {"height", "width"} / {"shortest_edge"} (others: _size's refusal)
_HF_SIZE = Kind(
    "a whole number > 0, or an object of them (height and width, or shortest_edge)", "sizes",
    lambda v: SIZE.test(v) or (isinstance(v, dict) and all(
        SIZE.test(v[k]) for k in ("height", "width", "shortest_edge") if k in v)),
)
HF_PREPROCESSOR: Schema = {
    "image_processor_type": TEXT,  # the class: how it reads an int size, its defaults
    "feature_extractor_type": TEXT,  # an older file's name for it
    "default_to_square": FLAG,  # an int size: a square (true) or a shortest edge
    "use_square_size": FLAG,  # CLIP's: its default shortest edge as a square (Kosmos-2's)
    "do_resize": FLAG,
    "size": _HF_SIZE,
    "do_center_crop": FLAG,
    "crop_size": _HF_SIZE,
    "resample": either(COUNT, TEXT),  # PIL's filter number (a name: read as one)
    "do_rescale": FLAG,
    "rescale_factor": NUMBER,
    "do_normalize": FLAG,
    "image_mean": either(NUMBER, list_of(NUMBER)),
    "image_std": either(NUMBER, list_of(NUMBER)),
}

OPEN_CLIP_MODEL: Schema = {  # the hub file's model_cfg; open_clip's model_configs/*.json whole
    "embed_dim": SIZE,
    "quick_gelu": FLAG,
    "vision_cfg": {
        "image_size": SQUARE,
        "layers": either(SIZE, list_of(SIZE)),  # a list: a ResNet tower (refused by its keys)
        "width": SIZE,
        "patch_size": SIZE,
        "head_width": SIZE,
        "mlp_ratio": POSITIVE,
        "pool_type": TEXT,
        "attentional_pool": FLAG,
        "final_ln_after_pool": FLAG,
        "norm_kwargs": {"eps": POSITIVE},
        "act_kwargs": {"approximate": TEXT},
    },
}
OPEN_CLIP_CONFIG: Schema = {
    "model_cfg": OPEN_CLIP_MODEL,
    **OPEN_CLIP_MODEL,  # the model_configs layout: no model_cfg wrapper (convert_open_clip)
    "preprocess_cfg": {
        "size": either(SIZE, list_of(SIZE)),
        "resize_mode": TEXT,
        "interpolation": TEXT,
        "mean": list_of(NUMBER),
        "std": list_of(NUMBER),
    },
}
