"""The pixel contract: image bytes or raw pixels -> the model's normalised input.

jax-free: one module for the server, the batch job and the probes, so all see the same pixels.
The contract (resize the shorter side, centre crop, normalise) comes from ``cfg.preprocess``;
``Preprocessor.describe()`` is what GetModelInfo publishes.

Untrusted bytes: only JPEG, PNG and WebP are opened; the declared size is checked against
``max_pixels`` before any pixel is decoded (decompression bombs), and every decoder failure
(truncated files, corrupt data) becomes an ``InvalidImage`` with the decoder's reason.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

from .config import ViTConfig
from .errors import InvalidImage

FORMATS = ("JPEG", "PNG", "WEBP")
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000  # about 7.3k x 5.5k; far beyond any model input
_RESAMPLE = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}


def decode(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> np.ndarray:
    """Encoded JPEG / PNG / WebP bytes -> uint8 [H, W, 3] RGB (first frame of animations)."""
    if not data:
        raise InvalidImage("empty image bytes")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise InvalidImage(
            f"not a JPEG, PNG or WebP image ({len(data)} bytes starting {data[:8]!r})"
        ) from None
    except Image.DecompressionBombError as err:
        raise InvalidImage(f"declared size is too large (decompression bomb?): {err}") from None
    except Exception as err:  # noqa: BLE001 - any header parser failure is the sender's data
        raise InvalidImage(f"unreadable image header: {type(err).__name__}: {err}") from None
    width, height = image.size
    check_size(height, width, max_pixels, f"declared size of the {image.format}")
    try:
        rgb = image.convert("RGB")  # decodes every pixel: truncated or corrupt data fails here
    except MemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - same: a decoder error means bad input, not a bug
        raise InvalidImage(
            f"cannot decode {image.format} image: {type(err).__name__}: {err}"
        ) from None
    return np.asarray(rgb)


def check_size(height: int, width: int, max_pixels: int, what: str = "image") -> None:
    if height <= 0 or width <= 0:
        raise InvalidImage(f"{what} is {width}x{height}: zero-sized")
    if height * width > max_pixels:
        raise InvalidImage(
            f"{what} is {width}x{height} = {height * width} pixels, over the limit of "
            f"{max_pixels} (decompression bomb guard)"
        )


def check_pixels(pixels: np.ndarray, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> np.ndarray:
    """Raw pixels must be uint8 [H, W, 3] with H, W > 0."""
    if pixels.dtype != np.uint8:
        raise InvalidImage(f"raw pixels must be uint8, got {pixels.dtype}")
    if pixels.ndim != 3 or pixels.shape[-1] != 3:
        raise InvalidImage(
            f"raw pixels must have shape [height, width, 3] (RGB), got {list(pixels.shape)}"
        )
    check_size(pixels.shape[0], pixels.shape[1], max_pixels, "raw image")
    return pixels


@dataclass(frozen=True)
class Preprocessor:
    """uint8 RGB pixels -> float32 [S, S, 3]: resize shorter side, centre crop, normalise."""

    cfg: ViTConfig

    def __post_init__(self) -> None:
        if self.cfg.preprocess.resize < self.cfg.image_size:
            raise ValueError(
                f"{self.cfg.name}: preprocess.resize={self.cfg.preprocess.resize} is smaller "
                f"than image_size={self.cfg.image_size}; the centre crop would not fit"
            )

    @property
    def hash(self) -> str:
        return self.cfg.preprocess_hash()

    def describe(self) -> str:
        p, size = self.cfg.preprocess, self.cfg.image_size
        return (
            f"decode (JPEG, PNG, WebP; first frame) -> RGB; resize the shorter side to "
            f"{p.resize} ({p.interpolation}, PIL, antialiased; longer side floor-scaled); "
            f"centre crop {size}x{size}; x/255; (x - mean) / std per channel with "
            f"mean={list(p.mean)} std={list(p.std)}; float32 [{size}, {size}, 3]"
        )

    def crop(self, pixels: np.ndarray) -> np.ndarray:
        """Resize and centre-crop: uint8 [H, W, 3] -> uint8 [S, S, 3]."""
        p, size = self.cfg.preprocess, self.cfg.image_size
        height, width = pixels.shape[:2]
        short = min(height, width)
        new_h = p.resize if height == short else int(p.resize * height / short)
        new_w = p.resize if width == short else int(p.resize * width / short)
        if (new_h, new_w) != (height, width):
            image = Image.fromarray(pixels).resize((new_w, new_h), _RESAMPLE[p.interpolation])
            pixels = np.asarray(image)
        top = int(round((new_h - size) / 2.0))
        left = int(round((new_w - size) / 2.0))
        return pixels[top : top + size, left : left + size]

    def normalise(self, pixels: np.ndarray) -> np.ndarray:
        p = self.cfg.preprocess
        mean = np.asarray(p.mean, np.float32)
        std = np.asarray(p.std, np.float32)
        return (pixels.astype(np.float32) / np.float32(255.0) - mean) / std

    def __call__(self, pixels: np.ndarray) -> np.ndarray:
        return self.normalise(self.crop(pixels))

    def load(self, image: bytes | np.ndarray, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
        """Encoded bytes or raw uint8 pixels -> the model input."""
        if isinstance(image, (bytes, bytearray, memoryview)):
            return self(decode(bytes(image), max_pixels))
        return self(check_pixels(np.asarray(image), max_pixels))
