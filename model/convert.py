"""Weight import: timm, Hugging Face transformers and big_vision checkpoints into this layout.

Each importer reads the source's tensors by name, infers the config from them (or from a preset,
``--model``), and regroups them into the head-grouped layout of model/vit.py. Every source tensor
is used exactly once: a missing, unexpected or mis-shaped key is an error naming it; the few that
have no place in a feature extractor (Hugging Face's tanh pooler, its masked-image-modelling mask
token) are dropped by name, and such notes go into the checkpoint's metadata.

One module per source (convert_timm, convert_hf, convert_big_vision, convert_open_clip) over
convert_common; the served preprocessing is convert_preprocess's, and models named on the Hugging
Face Hub are read from its cache (or downloaded) by hub.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

from . import hub
from .checkpoint import (
    expected_shapes,
    flatten,
    format_problems,
    shape_problems,
    shapes_of,
    unflatten,
)
from .config import SOURCES, ConfigError, ViTConfig
from .convert_common import (
    WEIGHT_FILES,
    ConvertError,
    Hints,
    SourceTensors,
    check_memory,
    find_weights,
    read_tensors,
    shard_index,
    unpacked_size,
)
from .convert_preprocess import PreprocessFlags, SourcePreprocess, resolve

# Config fields a checkpoint decides even when a preset is named (numerics of the source).
_SOURCE_DECIDES = ("norm_eps", "gelu_exact", "num_classes", "param_dtype")
_NOT_COMPARED = ("name", "compute_dtype", "preprocess", *_SOURCE_DECIDES)


@dataclass
class Converted:
    config: ViTConfig
    params: dict  # nested dict of numpy arrays in this project's layout
    source: str  # "timm:vit_base_patch16_224", "hf:facebook/dinov2-small@<commit>", ...
    notes: list[str] = field(default_factory=list)
    preprocess_from: str = ""  # "preprocessor_config.json", "flags (--mean) over ...", ...


# ------------------------------------------------------------------------------------------
# the entry point
# ------------------------------------------------------------------------------------------

# Each source module: SIDE_FILES (the config files it reads beside the weights) and side_files(path)
# -> what they say; canonical(tensors, notes) -> tensors under the names it reads; infer_config;
# preprocessing(side, image_size) -> SourcePreprocess; build_params.
IMPORTERS = {name: importlib.import_module(f"{__package__}.convert_{name}") for name in SOURCES}
HUB_SOURCES = ("hf", "timm", "open_clip")  # whose files the hub keeps under known names


def _source_name(path: Path, side: dict) -> str:
    if side.get("architecture"):  # timm's hub config.json
        return str(side["architecture"])
    return path.name if path.is_dir() else path.stem


def _locate(source: str, name, importer) -> tuple[Path, str | None]:
    """The local path to read, and for a hub model its name and commit (``spec@commit``)."""
    model = hub.parse(source, str(name))
    if model is None:
        return Path(name), None
    if source not in HUB_SOURCES:
        raise ConvertError(
            f"{name}: hub models are read for --from {', '.join(HUB_SOURCES)}; for {source}, "
            "download the weight file and pass its path"
        )
    weights = getattr(importer, "WEIGHT_FILES", WEIGHT_FILES)
    folder = hub.fetch(model, importer.SIDE_FILES, weights)
    return folder, f"{model.spec}@{folder.name}"


def _with_preset(cfg: ViTConfig, preset: ViTConfig, notes: list[str]) -> ViTConfig:
    """The preset's name, provided its architecture is the checkpoint's."""
    problems = shape_problems(
        expected_shapes(preset.replace(num_classes=cfg.num_classes, param_dtype="float32")),
        expected_shapes(cfg.replace(param_dtype="float32")),
        f"preset {preset.name}",
        "the checkpoint",
        dtypes=False,
    )
    problems += [
        f"{name}: the checkpoint has {getattr(cfg, name)!r}, preset {preset.name} has "
        f"{getattr(preset, name)!r}"
        for name in ViTConfig.__dataclass_fields__
        if name not in _NOT_COMPARED and getattr(cfg, name) != getattr(preset, name)
    ]
    if problems:
        raise ConvertError(format_problems(problems, f"the checkpoint is not a {preset.name}", 40))
    for name in _SOURCE_DECIDES:
        if getattr(cfg, name) != getattr(preset, name):
            notes.append(
                f"kept the checkpoint's {name}={getattr(cfg, name)!r} "
                f"(preset {preset.name} has {getattr(preset, name)!r})"
            )
    return cfg.replace(name=preset.name, compute_dtype=preset.compute_dtype)


def convert(
    source: str,
    input_path,
    hints: Hints | None = None,
    preprocess: PreprocessFlags | None = None,
) -> Converted:
    """Read a public checkpoint (a path, or a hub model name) and return it in this project's
    config and parameter layout; ``preprocess`` overrides what the source says about pixels."""
    hints = hints or Hints()
    if source not in IMPORTERS:
        raise ConvertError(f"unknown source {source!r}; one of {SOURCES}")
    importer = IMPORTERS[source]
    path, hub_name = _locate(source, input_path, importer)
    side = importer.side_files(path)
    notes: list[str] = []
    preferred = getattr(importer, "WEIGHT_FILES", WEIGHT_FILES)
    files = find_weights(path, preferred)
    check_memory(str(path), sum(unpacked_size(f) for f in files if f.is_file()))
    tensors = importer.canonical(read_tensors(files, shard_index(path, preferred), notes), notes)
    name = f"{source}:{hub_name or _source_name(path, side)}"
    t = SourceTensors(tensors, source)
    try:
        cfg = importer.infer_config(t, hints, side).replace(name=name)
    except KeyError as err:  # a key the inference needs
        raise ConvertError(f"{source} checkpoint: missing key {err.args[0]!r}") from None
    except ConfigError as err:
        raise ConvertError(f"{source} checkpoint gives an invalid config: {err}") from err
    if cfg.channels != 3:  # every image is decoded to RGB: the server's first request would fail
        raise ConvertError(
            f"{t.source} checkpoint: its patch embedding takes {cfg.channels}-channel images "
            "(timm in_chans, Hugging Face num_channels), which is not supported: the pixel "
            "contract serves RGB images (3 channels)"
        )
    cfg = cfg.replace(param_dtype=hints.dtype or t.float_dtype())
    if hints.preset is not None:
        cfg = _with_preset(cfg, hints.preset, notes)
    said = importer.preprocessing(side, cfg.image_size)
    if hints.preset is not None and not said.from_files:  # the files say nothing: the preset's
        preset = hints.preset
        said = SourcePreprocess.of_preset(preset.name, preset.preprocess, cfg.image_size)
    served, size, origin, more = resolve(said, preprocess or PreprocessFlags(), cfg)
    if size != cfg.image_size:  # served at the crop, its table resampled (DINOv2: 518 -> 224)
        fields = {"posemb_grid": cfg.grid} if cfg.posemb == "learn" else {}
        cfg = cfg.replace(image_size=size, **fields)
    cfg = cfg.replace(preprocess=served)
    notes += [*more, f"preprocessing from {origin}"]
    params = importer.build_params(t, cfg)
    t.finish()
    if t.scales_folded and cfg.param_dtype != "float32" and hints.dtype is None:
        # gamma * W rounded to the source's dtype again would move float32 features by ~1e-3
        notes.append(f"LayerScale folded into the projections: parameters kept in float32, not "
                     f"the checkpoint's {cfg.param_dtype} (--dtype {cfg.param_dtype} rounds them)")
        cfg = cfg.replace(param_dtype="float32")
    dtype = ml_dtypes.bfloat16 if cfg.param_dtype == "bfloat16" else np.float32
    params = unflatten({k: np.asarray(v, dtype) for k, v in flatten(params).items()})
    problems = shape_problems(expected_shapes(cfg), shapes_of(params), cfg.name, "the import")
    if problems:  # an importer bug, not a user error: say so plainly
        raise AssertionError(format_problems(problems, "importer bug: wrong layout"))
    return Converted(cfg, params, name, notes + t.notes, origin)
