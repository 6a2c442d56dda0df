"""Model configuration and named presets: the one source of truth for every architecture served.

Every difference between the ViT-22B recipe and a standard ViT is a field here, never a fork of the
model code.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Literal

from .schema import FLAG, NUMBER, TEXT, WHOLE, list_of, whole_number

BlockType = Literal["parallel", "sequential"]
NormType = Literal["layernorm", "layernorm_nobias", "rmsnorm"]
# prefix: the mean of the class token and the registers (timm's distilled DeiT: (CLS + dist) / 2)
HeadType = Literal["map", "cls", "gap", "prefix", "none"]
PosembType = Literal["learn", "sincos2d", "rope"]
MlpType = Literal["gelu", "quick_gelu", "swiglu"]
PosembResample = Literal["bicubic", "bicubic_antialias", "none"]
DType = Literal["float32", "bfloat16"]
INTERPOLATIONS = ("bicubic", "bilinear")  # the resamplings the pixel contract serves
CROP_OFFSETS = ("round", "floor")  # the centre crop offset's rules (Preprocess.crop_offset)
# The weight formats `vit22b convert` reads, each by its module convert_<source> (named here, not
# in convert.py, so that the command line lists them without importing jax).
SOURCES = ("timm", "hf", "big_vision", "open_clip")

_CHOICES = {
    "block": ("parallel", "sequential"),
    "norm": ("layernorm", "layernorm_nobias", "rmsnorm"),
    "head": ("map", "cls", "gap", "prefix", "none"),
    "posemb": ("learn", "sincos2d", "rope"),
    "mlp": ("gelu", "quick_gelu", "swiglu"),
    "posemb_resample": ("bicubic", "bicubic_antialias", "none"),
    "param_dtype": ("float32", "bfloat16"),
    "compute_dtype": ("float32", "bfloat16"),
}


# The version of the decoding and resampling rules in model/pixels.py (formats, orientation,
# colour modes, transparency, the resampled window). Part of the preprocessing hash: bump it with
# any change that can change the pixels the model sees. 2: EXIF orientation, BMP/GIF/TIFF,
# 16-bit grey scaled, transparency over white, I/F/LAB refused, bounded resampling window.
# 3: JPEG reduced-size decoding (DCT scaling) down to twice the resize's shorter side.
# A format accepted that was refused before changes no accepted image's pixels, so it is no new
# version (3 took AVIF and HEIC on 2026-12-06: features of every other file are the same).
PIXEL_RULES = 3


class ConfigError(ValueError):
    """A configuration that cannot describe a working model; the message names the field."""


# A field's declared type -> its kind and its Python type. A config read from a file (a
# checkpoint's metadata.json, a server's model info) is held to its types: "false" is not read
# as true, nor 0 as False, nor "1e-6" as a number.
_TYPES = {"bool": (FLAG, bool), "int": (WHOLE, int), "float": (NUMBER, float), "str": (TEXT, str)}
_CHANNELS = list_of(NUMBER, 3)  # a mean or std per channel R G B


def _typed(owner: object, where: str) -> None:
    """Hold each field of the dataclass ``owner`` whose declared type is in _TYPES (or that type
    or None) to it, storing the value as that type (numpy scalars as Python's)."""
    for f in dataclasses.fields(owner):
        kind, value = str(f.type), getattr(owner, f.name)
        optional = kind.endswith(" | None")
        kind = kind.removesuffix(" | None")
        if kind not in _TYPES or (optional and value is None):
            continue
        accepted, python_type = _TYPES[kind]
        if not accepted.test(value):
            raise ConfigError(f"{where}: {f.name}={value!r} is not {accepted.says}"
                              + (" or null" if optional else ""))
        object.__setattr__(owner, f.name, python_type(value))  # frozen: set once, here


@dataclass(frozen=True)
class Preprocess:
    """The preprocessing contract the server applies and publishes (resize, crop, normalise)."""

    resize: int = 224  # shorter side is resized to this, then centre-cropped to the image size
    interpolation: Literal["bicubic", "bilinear"] = "bicubic"
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    # False: both sides resized to the image size, no crop (the DINOv3 and SigLIP processors)
    crop: bool = True
    # the centre crop's offset, (resized - crop) / 2: rounded half to even as torchvision, timm
    # and open_clip take it, or floored as transformers' image processors do (both backends)
    crop_offset: Literal["round", "floor"] = "round"
    # False: both sides resized to ``resize`` before the centre crop, the aspect ratio not kept
    # (DeiT's processor, timm's crop_mode 'squash' with crop_pct < 1)
    keep_aspect: bool = True

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for name, default in (("crop", True), ("crop_offset", "round"), ("keep_aspect", True)):
            if d[name] == default:  # defaults left out: contracts (and hashes) from before stay
                d.pop(name)
        return d

    def __post_init__(self) -> None:
        _typed(self, "preprocess")
        if self.resize <= 0:
            raise ConfigError(f"preprocess: resize={self.resize} must be positive")
        if self.interpolation not in INTERPOLATIONS:
            raise ConfigError(f"preprocess: interpolation={self.interpolation!r} is not one of "
                              f"{INTERPOLATIONS}")
        if self.crop_offset not in CROP_OFFSETS:
            raise ConfigError(f"preprocess: crop_offset={self.crop_offset!r} is not one of "
                              f"{CROP_OFFSETS}")
        for name in ("mean", "std"):
            values = getattr(self, name)
            if not _CHANNELS.test(values):
                raise ConfigError(f"preprocess: {name}={values!r} is not {_CHANNELS.says}")
            object.__setattr__(self, name, tuple(float(v) for v in values))
        if min(self.std) <= 0:
            raise ConfigError(f"preprocess: std={self.std} must be positive")
        if not self.keep_aspect and not self.crop:  # one spelling of each contract (its hash)
            raise ConfigError("preprocess: keep_aspect=false needs crop=true (without a crop, "
                              "both sides are resized already)")

    @classmethod
    def from_dict(cls, d: dict) -> Preprocess:
        if not isinstance(d, dict):
            raise ConfigError(f"preprocess is {d!r}, not an object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown preprocess fields {unknown}")
        return cls(**d)


IMAGENET_PREPROCESS = Preprocess(resize=248, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))


@dataclass(frozen=True)
class ViTConfig:
    """One vision transformer. Defaults are the ViT-22B recipe; presets override what differs."""

    name: str = "custom"
    width: int = 6144
    depth: int = 48
    heads: int = 48
    mlp_dim: int = 24576
    patch: int = 14
    image_size: int = 224
    channels: int = 3
    patch_bias: bool = True  # CLIP's patch conv has none
    block: BlockType = "parallel"
    norm: NormType = "rmsnorm"
    norm_eps: float = 1e-6
    qkv_bias: bool = False
    out_bias: bool = True  # bias of the attention out-projection (folded into w_out's bias)
    mlp_bias: bool = True
    qk_norm: bool = True
    head: HeadType = "map"
    head_mlp_dim: int | None = None  # MAP head MLP hidden; None -> mlp_dim
    class_token: bool = False
    # register tokens (DINOv2-reg, DINOv3): after the class token, before the patches; they take
    # no position embedding and are never part of the patch outputs
    num_registers: int = 0
    # learn / sincos2d: a table added to the embedded patches; rope: DINOv3's 2-D rotary
    # embedding on the patches' queries and keys (patch centres in [-1, 1], base rope_theta)
    posemb: PosembType = "learn"
    # a learned table at another grid than the input's is resampled as its source does
    # (model/posemb.py): bicubic (Hugging Face ViT, DINOv2), bicubic_antialias (timm's
    # dynamic_img_size, Hugging Face DINOv2 with registers), none (its own grid only)
    posemb_resample: PosembResample = "bicubic_antialias"
    # the learned table's side when it is not image_size / patch (DINOv2: 37x37 at 518 px,
    # served at the processor's 224 crop); 0: the model's grid
    posemb_grid: int = 0
    rope_theta: float = 100.0
    # big_vision adds position embeddings to patches only, then prepends the class token;
    # timm and Hugging Face prepend first and embed the class token's position too.
    posemb_covers_cls: bool = False
    # timm's no_embed_class=False with registers: the table has a row for every prefix token
    # (the class token's and the registers'), kept as they are when it is resampled
    posemb_covers_registers: bool = False
    # a norm on the embedded tokens before the first block (timm pre_norm: CLIP, the *_xp_* ViTs)
    pre_norm: bool = False
    # the final norm on the pooled feature instead of the tokens (timm fc_norm: its
    # average-pooled ViTs, the SBB *_gap_* ones, EVA-L, BEiT-3); the tokens have no norm, so
    # they come out as the last block leaves them, norm_patches or not (as timm's
    # forward_features and forward_intermediates(norm=True) give them)
    pool_norm: bool = False
    gelu_exact: bool = True
    # the blocks' MLP: GELU (exact or tanh, gelu_exact), CLIP's quick-GELU x*sigmoid(1.702x), or
    # SwiGLU silu(x W_gate) * (x W_fc1) (DINOv2-g, DINOv3-7B); the MAP head's MLP is always GELU
    mlp: MlpType = "gelu"
    # a linear map (no bias) after pooling: CLIP's visual projection; pooled is its output
    projection_dim: int = 0
    num_classes: int = 0  # classifier head on the pooled feature (imported checkpoints); 0: none
    param_dtype: DType = "float32"
    compute_dtype: DType = "bfloat16"
    preprocess: Preprocess = field(default_factory=Preprocess)

    def __post_init__(self) -> None:
        _typed(self, self.name if isinstance(self.name, str) else "config")
        if not isinstance(self.preprocess, Preprocess):
            raise ConfigError(f"{self.name}: preprocess={self.preprocess!r} is not a "
                              "preprocessing contract")
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise ConfigError(f"{self.name}: {name}={value!r} is not one of {choices}")
        for name in ("width", "depth", "heads", "mlp_dim", "patch", "image_size", "channels"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{self.name}: {name}={getattr(self, name)} must be positive")
        for name in ("num_registers", "projection_dim", "num_classes", "posemb_grid"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{self.name}: {name}={getattr(self, name)} must be >= 0")
        if self.head_mlp_dim is not None and self.head_mlp_dim <= 0:
            raise ConfigError(f"{self.name}: head_mlp_dim={self.head_mlp_dim} must be positive")
        for name in ("norm_eps", "rope_theta"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{self.name}: {name}={getattr(self, name)} must be positive")
        if self.block == "parallel" and self.mlp == "swiglu":
            raise ConfigError(
                f"{self.name}: mlp='swiglu' needs block='sequential' (the fused projection of a "
                "parallel block has no gate)"
            )
        if self.posemb == "rope" and self.head_dim % 4:
            raise ConfigError(
                f"{self.name}: posemb='rope' needs head_dim divisible by 4, got {self.head_dim}"
            )
        if self.posemb_grid < 0 or (self.posemb_grid and self.posemb != "learn"):
            raise ConfigError(
                f"{self.name}: posemb_grid={self.posemb_grid} needs posemb='learn' and >= 0"
            )
        if self.posemb == "rope" and self.posemb_covers_cls:
            raise ConfigError(f"{self.name}: posemb='rope' has no table to cover the class token")
        if self.projection_dim and self.head == "none":
            raise ConfigError(f"{self.name}: projection_dim needs a pooling head")
        if self.width % self.heads:
            raise ConfigError(
                f"{self.name}: width={self.width} is not divisible by heads={self.heads}"
            )
        if self.block == "parallel" and self.mlp_dim % self.heads:
            raise ConfigError(
                f"{self.name}: mlp_dim={self.mlp_dim} is not divisible by heads={self.heads}; "
                "the head-grouped fused projection of a parallel block needs whole MLP slices "
                "per head"
            )
        if self.image_size % self.patch:
            raise ConfigError(
                f"{self.name}: image_size={self.image_size} is not divisible by patch={self.patch}"
            )
        if self.pool_norm and self.head == "none":
            raise ConfigError(f"{self.name}: pool_norm=True needs a pooling head")
        if self.head == "cls" and not self.class_token:
            raise ConfigError(f"{self.name}: head='cls' needs class_token=True")
        if self.head == "prefix" and not (self.class_token and self.num_registers):
            raise ConfigError(f"{self.name}: head='prefix' (the mean of the class token and the "
                              "registers) needs class_token=True and registers")
        if self.posemb_covers_registers and (
            not self.num_registers or self.posemb != "learn"
            or self.posemb_covers_cls != self.class_token
        ):
            raise ConfigError(
                f"{self.name}: posemb_covers_registers=True needs registers, a learned table "
                "and posemb_covers_cls=class_token (a row for every prefix token)"
            )
        if self.posemb_covers_cls and not self.class_token:
            raise ConfigError(f"{self.name}: posemb_covers_cls=True needs class_token=True")
        if self.num_classes and self.head == "none":
            raise ConfigError(f"{self.name}: num_classes={self.num_classes} needs a pooling head")

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def grid(self) -> int:
        return self.image_size // self.patch

    @property
    def num_patches(self) -> int:
        return self.grid * self.grid

    @property
    def table_grid(self) -> tuple[int, int]:
        """The grid of the learned position table as stored."""
        side = self.posemb_grid or self.grid
        return side, side

    def grid_at(self, height: int, width: int) -> tuple[int, int]:
        """The patch grid (rows, cols) of an input of height x width pixels."""
        if height % self.patch or width % self.patch or height <= 0 or width <= 0:
            raise ConfigError(
                f"{self.name}: an input of {height}x{width} pixels is not a whole number of "
                f"{self.patch}x{self.patch} patches"
            )
        return height // self.patch, width // self.patch

    def tokens_at(self, grid: tuple[int, int]) -> int:
        """Tokens of a sequence at ``grid``: the patches and the prefix tokens."""
        return grid[0] * grid[1] + self.num_prefix_tokens

    def flops_per_image(self, grid: tuple[int, int] | None = None) -> int:
        """Multiply-adds x 2 of one forward with the pooled output at ``grid`` (default: the
        model's own): matmuls and attention products."""
        n = grid[0] * grid[1] if grid else self.num_patches
        t, d, h, hd = n + self.num_prefix_tokens, self.width, self.heads, self.head_dim
        patch_embed = n * self.patch * self.patch * self.channels * d
        mlp_mats = 3 if self.mlp == "swiglu" else 2  # SwiGLU adds its gate
        block_dense = t * (4 * d * d + mlp_mats * d * self.mlp_dim)  # q, k, v, out + MLP
        block_attn = 2 * h * t * t * hd  # logits and the weighted sum of values
        macs = patch_embed + self.depth * (block_dense + block_attn)
        if self.head == "map":
            macs += n * 2 * d * d + 2 * d * d + 2 * h * n * hd + 2 * d * self.map_mlp_dim
        macs += d * (self.num_classes + self.projection_dim)
        return 2 * macs

    @property
    def posemb_prefix_rows(self) -> int:
        """Rows of the learned table before the patches' (prefix tokens it covers)."""
        return int(self.posemb_covers_cls) + self.num_registers * self.posemb_covers_registers

    def table_rows(self, grid: tuple[int, int]) -> int:
        """Rows of the learned position table at ``grid``: its prefix rows and the patches'."""
        return grid[0] * grid[1] + self.posemb_prefix_rows

    @property
    def num_prefix_tokens(self) -> int:
        """Tokens before the patches: the class token and the registers."""
        return int(self.class_token) + self.num_registers

    @property
    def num_tokens(self) -> int:
        return self.num_patches + self.num_prefix_tokens

    @property
    def pooled_dim(self) -> int:
        """Width of the pooled output (the projection's when there is one)."""
        return self.projection_dim or self.width

    @property
    def map_mlp_dim(self) -> int:
        return self.head_mlp_dim or self.mlp_dim

    # ---- (de)serialisation ----------------------------------------------------------------
    def replace(self, **changes) -> ViTConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["preprocess"] = self.preprocess.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ViTConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown config fields {unknown}")
        d = dict(d)
        if "preprocess" in d:
            d["preprocess"] = Preprocess.from_dict(d["preprocess"])
        return cls(**d)

    def preprocess_hash(self, geometry: dict | None = None) -> str:
        """Fingerprint of everything that decides the pixels the model sees; ``geometry``
        (``pixels.Geometry.key()``) when it is not the model's own square input."""
        contract = {
            "image_size": self.image_size,
            **self.preprocess.to_dict(),
            "pixel_rules": PIXEL_RULES,
            **({"geometry": geometry} if geometry else {}),
        }
        blob = json.dumps(contract, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _vit22b_recipe(name: str, width: int, depth: int, heads: int, **kw) -> ViTConfig:
    """The paper's recipe (parallel, QK-norm, RMSNorm, no QKV/norm biases, MAP, no class token)."""
    kw.setdefault("mlp_dim", 4 * width)
    kw.setdefault("patch", 14)
    # big_vision's recipe: resize the whole image to the input size (no crop margin).
    kw.setdefault("preprocess", Preprocess(resize=kw.get("image_size", 224)))
    return ViTConfig(name=name, width=width, depth=depth, heads=heads, **kw)


def _standard_vit(name: str, width: int, depth: int, heads: int, **kw) -> ViTConfig:
    """Original ViT (timm / Hugging Face / big_vision): sequential pre-norm blocks, CLS token."""
    base = dict(
        mlp_dim=4 * width,
        patch=16,
        block="sequential",
        norm="layernorm",
        norm_eps=1e-6,
        qkv_bias=True,
        qk_norm=False,
        head="cls",
        class_token=True,
        posemb_covers_cls=True,
        param_dtype="float32",
        preprocess=IMAGENET_PREPROCESS,
    )
    base.update(kw)
    return ViTConfig(name=name, width=width, depth=depth, heads=heads, **base)


# The public frozen-feature backbones. Preprocessing from the sources' own files: timm's
# pretrained_cfg for DINOv2 (518 px, crop_pct 1.0, bicubic), Hugging Face preprocessor_config.json
# for DINOv3 (224x224, bilinear, no crop), SigLIP (224x224, bicubic, 0.5, no crop) and CLIP
# (shorter side 224, centre crop, bicubic, OpenAI's mean/std).
OPENAI_CLIP_PREPROCESS = Preprocess(
    resize=224, mean=(0.48145466, 0.4578275, 0.40821073), std=(0.26862954, 0.26130258, 0.27577711)
)
_IMAGENET = dict(mean=IMAGENET_PREPROCESS.mean, std=IMAGENET_PREPROCESS.std)


def _dinov2(name: str, width: int, depth: int, heads: int, **kw) -> ViTConfig:
    """DINOv2: LayerScale (folded at import), class token, 37x37 learned positions at 518 px."""
    kw.setdefault("preprocess", Preprocess(resize=518, **_IMAGENET))
    return _standard_vit(name, width, depth, heads, patch=14, image_size=518, **kw)


def _dinov3(name: str, width: int, depth: int, heads: int, **kw) -> ViTConfig:
    """DINOv3 ViT: 2-D RoPE, 4 registers, no key bias (zeros), LayerNorm eps 1e-5."""
    return _standard_vit(
        name,
        width,
        depth,
        heads,
        patch=16,
        norm_eps=1e-5,
        posemb="rope",
        posemb_covers_cls=False,
        num_registers=4,
        preprocess=Preprocess(resize=224, interpolation="bilinear", crop=False, **_IMAGENET),
        **kw,
    )


def _siglip(name: str, width: int, depth: int, heads: int, **kw) -> ViTConfig:
    """SigLIP image tower: no class token, MAP head, tanh GELU, mean/std 0.5."""
    return _standard_vit(
        name,
        width,
        depth,
        heads,
        head="map",
        class_token=False,
        posemb_covers_cls=False,
        gelu_exact=False,
        preprocess=Preprocess(resize=224, crop=False),
        **kw,
    )


def _clip(name: str, width: int, depth: int, heads: int, **kw) -> ViTConfig:
    """OpenAI CLIP image tower: pre-norm, quick-GELU, LayerNorm 1e-5, no patch bias, projection."""
    return _standard_vit(
        name,
        width,
        depth,
        heads,
        pre_norm=True,
        mlp="quick_gelu",
        norm_eps=1e-5,
        patch_bias=False,
        preprocess=OPENAI_CLIP_PREPROCESS,
        **kw,
    )


PRESETS: dict[str, ViTConfig] = {
    c.name: c
    for c in (
        _vit22b_recipe("vit-22b/14", 6144, 48, 48, param_dtype="bfloat16"),
        # The same recipe scaled down. "tiny" is the embedded default served with no arguments.
        _vit22b_recipe("vit-22b-tiny/16", 64, 4, 4, patch=16, image_size=64),
        _vit22b_recipe("vit-22b-small/14", 384, 12, 6),
        _vit22b_recipe("vit-22b-base/14", 768, 12, 12),
        _vit22b_recipe("vit-22b-large/14", 1024, 24, 16),
        _standard_vit("vit-ti/16", 192, 12, 3),
        _standard_vit("vit-s/16", 384, 12, 6),
        _standard_vit("vit-b/16", 768, 12, 12),
        _standard_vit("vit-l/16", 1024, 24, 16),
        _standard_vit("vit-h/14", 1280, 32, 16, patch=14),
        _dinov2("dinov2-s/14", 384, 12, 6),
        _dinov2("dinov2-b/14", 768, 12, 12),
        _dinov2("dinov2-l/14", 1024, 24, 16),
        _dinov2("dinov2-g/14", 1536, 40, 24, mlp="swiglu", mlp_dim=4096),
        _dinov2("dinov2-reg-b/14", 768, 12, 12, num_registers=4),
        _dinov2("dinov2-reg-g/14", 1536, 40, 24, num_registers=4, mlp="swiglu", mlp_dim=4096),
        _dinov3("dinov3-s/16", 384, 12, 6),
        _dinov3("dinov3-b/16", 768, 12, 12),
        _dinov3("dinov3-l/16", 1024, 24, 16),
        _siglip("siglip-b/16", 768, 12, 12),
        _siglip("siglip-so400m/14", 1152, 27, 16, mlp_dim=4304, patch=14),
        _clip("clip-b/16", 768, 12, 12, projection_dim=512),
        _clip("clip-l/14", 1024, 24, 16, patch=14, projection_dim=768),
    )
}

DEFAULT_MODEL = "vit-22b-tiny/16"


def parse_seed(text: str) -> int:
    """A weight seed as a flag spells it: an integer of the 64 signed bits jax's random keys
    take (a larger one ended in an OverflowError deep in the initialisation)."""
    try:
        seed = whole_number(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a seed is an integer, got {text!r}") from None
    if not -(2**63) <= seed < 2**63:
        raise argparse.ArgumentTypeError(f"a seed is a 64-bit signed integer, got {text}")
    return seed


def get_config(name: str) -> ViTConfig:
    """The named preset; an unknown name lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise ConfigError(f"unknown model preset {name!r}; known presets: {known}") from None
