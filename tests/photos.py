"""Photo-like pictures for the pixel tests and the decoding benchmark: smooth gradients, shapes
with hard edges, thin lines, a lens blur, grain and sensor noise (pure noise is not a photo: it
has no low frequencies for reduced-size decoding to keep)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageDraw, ImageFilter


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """A photo-like RGB picture: sky-like gradient, blurred and sharp shapes, texture, noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([
        120 + 90 * (y / height) + 20 * np.sin(x / width * 3.1),
        140 + 60 * np.cos(y / height * 2.0) - 30 * (x / width),
        200 - 110 * (y / height) + 15 * np.sin((x + y) / width * 5.0),
    ], axis=-1)
    image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(40):  # objects: filled shapes with hard edges
        x0, y0 = rng.integers(0, width), rng.integers(0, height)
        w, h = rng.integers(width // 40, width // 5), rng.integers(height // 40, height // 5)
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        box = (int(x0), int(y0), int(x0 + w), int(y0 + h))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
    for _ in range(60):  # thin lines: branches, wires, text-like edges
        points = [tuple(int(v) for v in rng.integers(0, (width, height))) for _ in range(2)]
        draw.line(points, fill=tuple(int(c) for c in rng.integers(0, 256, 3)),
                  width=int(rng.integers(1, 6)))
    image = image.filter(ImageFilter.GaussianBlur(radius=0.8))  # a lens is not a ruler
    pixels = np.asarray(image).astype(np.float32)
    texture = rng.standard_normal((height // 4 + 1, width // 4 + 1, 1)).astype(np.float32)
    texture = np.repeat(np.repeat(texture, 4, 0), 4, 1)[:height, :width]  # grain at 4 px
    noise = rng.normal(0, 4.0, pixels.shape).astype(np.float32)  # sensor noise
    return Image.fromarray(np.clip(pixels + 6 * texture + noise, 0, 255).astype(np.uint8))


def photo_jpeg(width: int, height: int, seed: int = 0, quality: int = 90) -> bytes:
    buffer = io.BytesIO()
    photo(width, height, seed).save(buffer, format="JPEG", quality=quality, subsampling="4:2:0")
    return buffer.getvalue()


def heic(image: Image.Image, *more: Image.Image, **params) -> bytes:
    """``image`` (and ``more`` after it) as a HEIC file written by libheif's encoder
    (pillow-heif's x265); ``params`` are its save options (quality, tile_size, primary_index).
    An EXIF orientation in ``image.info`` becomes irot/imir boxes and stays in the EXIF, as a
    phone writes both."""
    import pillow_heif

    file = pillow_heif.from_pillow(image)
    for other in more:
        file.add_from_pillow(other)
    buffer = io.BytesIO()
    file.save(buffer, **params)
    return buffer.getvalue()
