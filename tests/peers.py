"""PyTorch peers for parity tests: timm's and Hugging Face's own model code, run on CPU torch.

Running timm without torchvision
--------------------------------
timm 1.0.x imports torchvision at import time, and PyPI's torchvision wheels do not load beside
the CPU torch 2.13.0 wheel used here. The names timm's import path reads from torchvision are
few and all belong to its data pipeline and BatchNorm freezing, never to a ViT's forward:

    torchvision.transforms.ToTensor                 (subclassed by timm.data.MaybeToTensor)
    torchvision.transforms.{Normalize, Compose, Resize, CenterCrop, ...}  (open_clip.transform)
    torchvision.transforms.functional.InterpolationMode   (enum members put in module dicts)
    torchvision.ops.misc.FrozenBatchNorm2d          (named in timm.layers, timm.utils)
    torchvision.datasets.{CIFAR10, CIFAR100, MNIST, KMNIST, FashionMNIST, ImageFolder}

(the others, e.g. torchvision.models.feature_extraction, are imported inside try/except
ImportError and simply stay absent). ``import_timm()`` (and ``import_open_clip()``) registers a
stand-in ``torchvision`` package providing exactly those names for the duration of the import,
then removes it from
``sys.modules`` again, so that ``importlib.util.find_spec("torchvision")`` keeps answering None
(transformers asks) and a later ``import torchvision`` fails as it should. ``InterpolationMode``
is a real enum with torchvision's values; every stand-in class raises ``RuntimeError`` when
instantiated, so anything that reached torchvision fails loudly instead of quietly doing
something else. timm's own modules (VisionTransformer, Block, Attention, ParallelScalingBlock,
AttentionPoolLatent, RmsNorm, ...) then run unmodified. If a real torchvision imports, it is used.
"""

from __future__ import annotations

import enum
import importlib
import sys
import types

import numpy as np

STAND_IN_VERSION = "0+vit22b.stand-in"


def _unavailable(qualname: str, base: type = object) -> type:
    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            f"{qualname} is a stand-in (torchvision is not installed beside this torch); "
            "see tests/peers.py"
        )

    return type(qualname.rsplit(".", 1)[-1], (base,), {"__init__": __init__})


class InterpolationMode(enum.Enum):
    """torchvision.transforms.functional.InterpolationMode's members and values."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


# what timm (ToTensor) and open_clip's transform module import from torchvision.transforms
_TRANSFORMS = (
    "ToTensor",
    "Normalize",
    "Compose",
    "RandomResizedCrop",
    "Resize",
    "CenterCrop",
    "ColorJitter",
    "Grayscale",
)


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # a package: unknown submodules raise ModuleNotFoundError
    module.__dict__.update(attrs)
    return module


def _stand_in_modules() -> list[types.ModuleType]:
    import torch

    functional = _module("torchvision.transforms.functional", InterpolationMode=InterpolationMode)
    transforms = _module(
        "torchvision.transforms",
        functional=functional,
        InterpolationMode=InterpolationMode,
        **{name: _unavailable(f"torchvision.transforms.{name}") for name in _TRANSFORMS},
    )
    misc = _module(
        "torchvision.ops.misc",
        FrozenBatchNorm2d=_unavailable("torchvision.ops.misc.FrozenBatchNorm2d", torch.nn.Module),
    )
    ops = _module("torchvision.ops", misc=misc)
    datasets = _module(
        "torchvision.datasets",
        **{
            name: _unavailable(f"torchvision.datasets.{name}")
            for name in ("CIFAR10", "CIFAR100", "MNIST", "KMNIST", "FashionMNIST", "ImageFolder")
        },
    )
    root = _module(
        "torchvision",
        __version__=STAND_IN_VERSION,
        transforms=transforms,
        ops=ops,
        datasets=datasets,
    )
    return [root, transforms, functional, ops, misc, datasets]


_used_stand_in = False


def import_timm():
    """``timm``, importing a real torchvision if one loads, else with the stand-in above."""
    return _import_beside_torchvision("timm")


def import_open_clip():
    """``open_clip`` (its transform module imports torchvision's transforms by name)."""
    import_timm()  # open_clip imports timm and transformers when they are installed;
    importlib.import_module("transformers")  # transformers asks find_spec("torchvision")
    return _import_beside_torchvision("open_clip")


def _import_beside_torchvision(package: str):
    global _used_stand_in
    if package in sys.modules:
        return sys.modules[package]
    try:
        importlib.import_module("torchvision")
    except Exception:  # absent, or present but built for another torch
        for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        stand_in = _stand_in_modules()
        sys.modules.update({module.__name__: module for module in stand_in})
        try:
            module = importlib.import_module(package)
        finally:
            for module_ in stand_in:
                del sys.modules[module_.__name__]
        _used_stand_in = True
        return module
    return importlib.import_module(package)


def uses_stand_in() -> bool:
    return _used_stand_in


def perturb(module, seed: int = 0, scale: float = 0.05) -> None:
    """Add noise to every parameter and saved buffer, so zero biases, unit norms and a LayerScale
    of 1e-5 do not hide a mapping error (a mis-assigned bias is invisible while all are zero).
    Buffers that are not saved (DINOv3's RoPE frequencies) are the code's, not weights: kept."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    saved = {id(t): t for t in module.state_dict(keep_vars=True).values()}
    with torch.no_grad():
        for tensor in saved.values():
            if tensor.is_floating_point():
                tensor.add_(scale * torch.randn(tensor.shape, generator=gen, dtype=tensor.dtype))


def rel_err(actual, expected) -> float:
    """Relative error ||a - b|| / ||b|| over the whole array."""
    a, b = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def vit_layout_outputs(model, pixels, interpolate: bool = False) -> dict:
    """ViT's layout (ViT-MSN, ViT-MAE, I-JEPA, DeiT): the class token, DeiT's distillation token
    (served as a register), then the patches; I-JEPA has no class token and its classifier reads
    the tokens' mean. ViT-MAE is run unmasked (mask_ratio 0) with its patches left in order."""
    import torch

    kw = {"interpolate_pos_encoding": True} if interpolate else {}
    model_type = model.config.model_type
    if model_type == "vit_mae":
        patch = model.config.patch_size
        n = (pixels.shape[2] // patch) * (pixels.shape[3] // patch)
        kw["noise"] = torch.arange(float(n)).expand(len(pixels), n)  # argsort: the identity
    tokens = model(pixel_values=pixels, **kw).last_hidden_state
    prefix = {"ijepa": 0, "deit": 2}.get(model_type, 1)
    pooled = tokens[:, 0] if prefix else tokens.mean(1)
    peer = {"pooled": pooled, "patch_tokens": tokens[:, prefix:]}
    if prefix == 2:
        peer["register_tokens"] = tokens[:, 1:2]
    return peer
