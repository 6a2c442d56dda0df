"""The preprocessing a converted checkpoint serves: what the source's files say (or the source's
defaults, or a named preset's, where they say nothing), then ``vit22b convert``'s flags
(``--mean``, ``--std``, ``--resize``, ``--crop``, ``--interpolation``) over any of it.

Each value is checked where it is served, naming where it came from: three finite means and
three positive stds, a known interpolation, a crop (the model's input size) of whole patches, no
larger than the resize, and other than the position table's only where the table is resampled.
A square resize without a crop (the ViT, SigLIP and DINOv3 processors) is served as such
(``Preprocess.crop`` False) unless ``--resize`` chooses the shorter-side resize and centre crop;
a geometry the contract cannot serve is refused unless ``--resize`` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import INTERPOLATIONS, Preprocess, ViTConfig
from .convert_common import ConvertError

FIELDS = ("resize", "crop", "interpolation", "mean", "std")


@dataclass(frozen=True)
class SourcePreprocess:
    """What a source says, every field filled: from its files where they say it (``from_files``),
    else its own defaults. Values as the source spells them; checked only once served (a flag
    may replace them)."""

    where: str  # "preprocessor_config.json", "config.json pretrained_cfg", "hf defaults", ...
    from_files: bool
    resize: int
    crop: int
    interpolation: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    geometry: str | None = None  # a resize the contract cannot serve, in the source's words
    squash: bool = False  # both sides resized to ``resize`` (no crop where it is ``crop``)
    crop_offset: str = "round"  # Preprocess.crop_offset: how the source centres its crop
    # why the source's preprocessing cannot be read (a processor class not known here, whose
    # own steps may differ from the values it keeps): served only when the flags give it whole
    unread: str | None = None

    @classmethod
    def of_preset(cls, name: str, p: Preprocess, image_size: int) -> SourcePreprocess:
        where = f"preset {name}"
        return cls(
            where, False, p.resize, image_size, p.interpolation, p.mean, p.std, None, not p.crop
        )


@dataclass(frozen=True)
class PreprocessFlags:
    """The flags given (None: not given); each replaces the source's value."""

    resize: int | None = None
    crop: int | None = None
    interpolation: str | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in FIELDS:
            value = getattr(self, name)
            if value is not None:
                _check(name, value, f"--{name}")

    def given(self) -> tuple[str, ...]:
        return tuple(f"--{name}" for name in FIELDS if getattr(self, name) is not None)


def unservable(field: str, mode: str, size: int, kinds: dict[str, str]) -> str | None:
    """How a source's resize ``mode`` (its ``field``) differs from the contract, in words; None
    when it is the contract's own. ``kinds`` names the source's modes: 'shortest' (the shorter
    side, a centre crop), 'squash' (a fixed square) or 'longest' (the longer side, padded)."""
    kind = kinds.get(mode)
    if kind == "shortest":
        return None
    if kind == "squash":
        return (
            f"{field} {mode!r} resizes every image to {size}x{size} (the aspect ratio is not kept)"
        )
    if kind == "longest":
        return f"{field} {mode!r} resizes the longer side and pads"
    return f"{field} {mode!r} is not a resize mode known here"


def _check(name: str, value, origin: str) -> None:
    if name in ("resize", "crop"):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConvertError(f"{name} {value!r} ({origin}): needs a positive whole number")
    elif name == "interpolation":
        if value not in INTERPOLATIONS:
            raise ConvertError(
                f"interpolation {value!r} ({origin}) is not one the pixel contract serves "
                f"({', '.join(INTERPOLATIONS)}): pass --interpolation {'|'.join(INTERPOLATIONS)}"
            )
    else:
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        ok = len(values) == 3 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for v in values
        )
        if ok and name == "std":
            ok = all(v > 0 for v in values)
        if not ok:
            what = "positive numbers" if name == "std" else "finite numbers"
            raise ConvertError(
                f"{name} {value!r} ({origin}): needs 3 {what}, one per channel R G B"
            )


def resolve(
    said: SourcePreprocess, flags: PreprocessFlags, cfg: ViTConfig
) -> tuple[Preprocess, int, str, list[str]]:
    """The served contract, its input size, where it came from (for the summary), and notes."""
    values = {
        name: getattr(flags, name) if getattr(flags, name) is not None else getattr(said, name)
        for name in FIELDS
    }

    def origin(name: str) -> str:
        return f"--{name}" if getattr(flags, name) is not None else said.where

    notes = []
    if said.unread:
        if len(flags.given()) < len(FIELDS):
            raise ConvertError(
                f"{said.where}: {said.unread}; give the preprocessing whole instead: "
                + " ".join(f"--{name} ..." for name in FIELDS))
        notes.append(f"{said.where}: {said.unread}; served: the flags'")
    squash = said.squash and flags.resize is None
    if said.geometry or said.squash and not squash:
        what = said.geometry or f"resizes every image to {said.resize}x{said.resize}"
        if flags.resize is None:
            raise ConvertError(
                f"{said.where}: {what}, which the pixel contract cannot serve; pass --resize N "
                "to serve the shorter side resized to N and a centre crop instead"
            )
        notes.append(f"{said.where}: {what}; served: --resize {flags.resize}, centre crop")
    for name in FIELDS:
        _check(name, values[name], origin(name))
    crop, resize = values["crop"], values["resize"]
    squash_crop = squash and said.resize != said.crop  # both sides resized, then a centre crop
    if squash and not squash_crop:  # both sides to the input size (--crop's too)
        resize = crop
    _check_input(crop, origin("crop"), cfg)
    if resize < crop:
        raise ConvertError(
            f"resize {resize} ({origin('resize')}) is smaller than the crop {crop} "
            f"({origin('crop')}): the centre crop would not fit"
        )
    served = Preprocess(
        resize=resize,
        interpolation=values["interpolation"],
        mean=tuple(float(v) for v in values["mean"]),
        std=tuple(float(v) for v in values["std"]),
        crop=not squash or squash_crop,
        crop_offset=said.crop_offset if not squash or squash_crop else "round",  # no crop: none
        keep_aspect=not squash_crop,
    )
    given = flags.given()
    if not given:
        where = said.where
    elif len(given) == len(FIELDS):
        where = "flags"
    else:
        where = f"flags ({', '.join(given)}) over {said.where}"
    return served, crop, where, notes


def _check_input(size: int, origin: str, cfg: ViTConfig) -> None:
    """The served input (``size`` square) must be whole patches, and other than the learned
    table's only where the table is resampled."""
    if size % cfg.patch:
        raise ConvertError(
            f"{origin} gives {size}x{size} inputs, not a whole number of {cfg.patch}x{cfg.patch} "
            "patches"
        )
    if size != cfg.image_size and cfg.posemb == "learn" and cfg.posemb_resample == "none":
        raise ConvertError(
            f"{origin} gives {size}x{size} inputs, but the position table is for "
            f"{cfg.image_size}x{cfg.image_size} and this model does not resample it"
        )
