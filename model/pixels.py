"""The pixel contract: image bytes or raw pixels -> the model's normalised input.

The server stops at the uint8 crop (``Preprocessor.crop``) and the compiled forward normalises
by ``level_table``; ``Preprocessor.__call__`` / ``load`` apply the whole contract on the host.

jax-free (numpy and Pillow): one module for the server, the batch job and the probes, so all see
the same pixels. ``Preprocessor.describe()`` is what GetModelInfo publishes; its hash,
``ViTConfig.preprocess_hash()``, covers ``cfg.preprocess`` and ``PIXEL_RULES`` (the version of
the decoding and resampling rules below).

Untrusted bytes (``decode``):

- Formats: JPEG (an MPO's first picture), PNG, WebP, AVIF, HEIC (HEIF with HEVC, phones'
  photos; decoded by libheif through pillow-heif, which the ``model`` extra installs), BMP, GIF
  and TIFF, recognised by their signature (AVIF and HEIC: their ISO brands), never by a file
  name; animations and multi-page files give their first frame, a HEIF file its primary image.
  A file of another format Pillow knows, or of a well-known one it does not (JPEG XL, a video,
  ...), is refused naming that format; so are camera raws, TIFF files whose first image is a
  preview or thumbnail (``_camera_raw``).
- Size: the declared size is checked against ``max_pixels`` (the server's
  ``--max-image-pixels``) before any pixel is decoded. Pillow's own bomb guard (one
  process-wide setting, read inside its GIF and TIFF plugins) is raised to at least that limit,
  never lowered, so it never refuses what the limit allows; what it still refuses is over the
  limit and reported as such.
- Orientation: the EXIF (or XMP) orientation is applied, as phone photos expect. An AVIF's is
  its ``irot``/``imir`` boxes (Pillow puts them in its EXIF orientation; an EXIF orientation
  the boxes do not confirm is dropped, as browsers ignore it). A HEIC's is its boxes alone,
  applied by libheif as it decodes; its EXIF orientation (a phone writes both) is never applied
  again, as the HEIF standard says.
- Colour: every mode becomes 8-bit RGB. Bilevel, grey and palette images are expanded; 16-bit
  grey (``I;16``, ``I;16B``, ...) is scaled by 255/65535 and rounded (16-bit colour PNG and
  TIFF arrive from Pillow as their high bytes, a 10- or 12-bit HEIC from libheif as its high 8
  bits); CMYK (naive, no ICC profile) and YCbCr (JFIF)
  go through Pillow's conversions; transparency (alpha channels, PNG tRNS, GIF transparency) is
  composited over ``BACKGROUND``. 32-bit integer (``I``) and float (``F``) pixels carry no range
  (which values are black and white), and Pillow has no faithful CIELab conversion: refused.
- Reduced-size decoding: given the shorter side the resize needs (``min_side``), a JPEG is
  decoded at 1/2, 1/4 or 1/8 of its size by libjpeg's DCT scaling (Pillow's ``draft``): the
  largest scale that divides both sides (no partial pixel) and keeps both at least
  ``DRAFT_MARGIN`` times ``min_side`` (``draft_scale``), so the resize that follows always
  reduces by at least that factor and never upsamples. A 4000x3000
  photo for ViT-B/16 (resize 248) decodes at 1/4 (1000x750). On photo-like JPEGs the resized
  crop stays within 1 level of 255 of full decoding's on average and 10 levels at the 99.9th
  percentile (tests/test_pixels.py; speed and differences: benchmarks/decode.py). Other formats,
  and JPEGs whose sides no scale divides, decode in full.
- Decoders: Pillow parses every header and decodes every format. A baseline or progressive
  JFIF JPEG in RGB or grey, upright (no EXIF orientation to apply) and decoded at full size, is
  decoded by simplejpeg instead when it is installed (the ``model`` extra installs it): the
  same libjpeg-turbo with the same settings (accurate DCT, fancy upsampling), so the same pixels
  bit for bit (tests/test_pixels.py). The contract's decode of a 64x64 JPEG took half the time
  (``python benchmarks/serve_parts.py``, ``decode_us``), and decoding is most of a small
  image's cost on the server (benchmarks/NOTES.md). Whatever it would warn about (truncated or
  corrupt data) goes back to Pillow, whose answer or reason stands. A plain JPEG whose markers
  alone say so (``plain_jpeg``: one 8-bit frame of 1 or 3 components, at most a standard JFIF
  segment among the application segments, every segment whole) skips Pillow's header parser
  too, pure Python as costly as the decode itself at 64x64; its size is checked as Pillow's
  route checks it, in the same words.
- Every decoder failure (truncated files, corrupt data) becomes an ``InvalidImage`` with the
  decoder's reason; a known format that cannot be used (zero width or height, an unsupported
  variant) says so.

Raw pixels (``check_pixels``) are taken as given: uint8 [H, W, 3].

Resizing keeps memory bounded by the crop whatever the aspect ratio: the shorter-side resize is
done in full (exactly torchvision's PIL Resize + CenterCrop) while it holds at most
``FULL_RESIZE_CROPS`` crops' worth of pixels (an aspect ratio of 64:1 when the resize equals the
crop); past that only the source box that the centre crop keeps is resampled (within 2 levels of
the full resize on smooth images; Pillow may order its two passes differently there).
"""

from __future__ import annotations

import ast
import functools
import io
import math
import re
import struct
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from PIL import ExifTags, Image

from .config import PIXEL_RULES, Preprocess, ViTConfig
from .errors import InvalidImage

try:  # the fast decoder for plain JPEGs (``_decode_jfif``); Pillow decodes everything without it
    import simplejpeg
except ImportError:  # pragma: no cover - the model extra installs it
    simplejpeg = None

FORMATS = ("JPEG", "PNG", "WEBP", "AVIF", "HEIF", "BMP", "GIF", "TIFF")
FORMAT_NAMES = "JPEG, PNG, WebP, AVIF, HEIC, BMP, GIF or TIFF"
_BY_BRANDS = {"AVIF": "AVIF", "HEIF": "HEIC"}  # the formats whose ISO brands decide (_iso_kind)
# The names files of those formats go by, for loaders that pick images out of a folder by name
# (the format itself is read from the bytes).
SUFFIXES = (".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".webp", ".avif", ".heic", ".heif", ".hif",
            ".bmp", ".dib", ".gif", ".tif", ".tiff")
# Names of image files in formats this contract refuses: a loader that picks by name lists them
# too, so that their refusal names them instead of a folder's silently losing them.
REFUSED_SUFFIXES = (".jxl", ".jp2", ".j2k", ".ppm", ".pgm", ".pbm",
                    ".pnm", ".tga", ".ico", ".pcx", ".psd", ".svg", ".dng", ".cr2", ".cr3",
                    ".nef", ".arw")
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000  # about 7.3k x 5.5k; far beyond any model input
BACKGROUND = (255, 255, 255)  # what transparent pixels show: white, as image viewers do
FULL_RESIZE_CROPS = 64  # the full shorter-side resize up to this many crops' worth of pixels
DRAFT_MARGIN = 2  # JPEG DCT scaling keeps both sides >= this x the side the resize needs
_RESAMPLE = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")
_EXPANDED = ("1", "L", "P", "RGBX", "CMYK", "YCbCr", "HSV")  # Pillow's convert("RGB") is right
_REFUSED = {
    "I": "32-bit integer pixels have no unambiguous 8-bit mapping (the file does not say which "
    "values are black and white)",
    "F": "32-bit floating-point pixels have no unambiguous 8-bit mapping (their range may be "
    "0..1, 0..255 or unbounded)",
    "LAB": "CIELab colour needs a colour-managed conversion to RGB, which is not applied",
}
_ORIENTATION = {  # EXIF orientation -> the transpose that shows the picture upright
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}

Image.init()  # register every plugin once: refused formats are named by their signature
_PILLOW_GUARD = threading.Lock()


def decode(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, min_side: int = 0
           ) -> np.ndarray:
    """Encoded image bytes -> uint8 [H, W, 3] RGB, upright (the rules in the module docstring).

    ``min_side``: the shorter side the resize that follows needs; a JPEG then decodes at a
    reduced size that keeps both sides >= ``DRAFT_MARGIN`` x ``min_side`` (0: full size)."""
    if (pixels := _decode_plain(data, max_pixels, min_side)) is not None:
        return pixels
    return decode_opened(open_encoded(data, max_pixels), max_pixels, min_side)


# The segments a plain JPEG may hold before its first scan (``plain_jpeg``): quantisation and
# Huffman tables, restart interval, comment; frames: baseline, extended sequential, progressive.
_PLAIN_SEGMENTS = frozenset({0xDB, 0xC4, 0xDD, 0xFE})
_PLAIN_FRAMES = frozenset({0xC0, 0xC1, 0xC2})
_SOS = 0xDA


def plain_jpeg(data: bytes) -> tuple[int, int, int] | None:
    """(height, width, components) of a plain JPEG, read from its bytes, or None.

    Plain: what ``_decode_jfif`` takes, told without Pillow's header parser (pure Python, as
    long as simplejpeg's whole decode of a 64x64 image): an 8-bit baseline or progressive frame
    of 1 or 3 components, at most a standard JFIF segment among the application segments (no
    Exif or XMP orientation, ICC profile, MPF picture index or Adobe colour transform), no fill
    bytes, every segment whole. Anything else is None and goes to Pillow, whose answer stands."""
    if simplejpeg is None or data[:3] != b"\xff\xd8\xff":
        return None
    pos, end, frame = 2, len(data), None
    while pos + 4 <= end:
        marker = data[pos + 1]
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        if data[pos] != 0xFF or length < 2 or pos + 2 + length > end:
            return None
        if marker == _SOS:
            return frame
        segment = data[pos + 4 : pos + 2 + length]
        if marker in _PLAIN_FRAMES:
            if frame is not None or len(segment) < 6 or segment[0] != 8:
                return None
            height, width = int.from_bytes(segment[1:3], "big"), int.from_bytes(segment[3:5], "big")
            if segment[5] not in (1, 3) or not height or not width:
                return None
            frame = height, width, segment[5]
        elif marker == 0xE0:  # APP0: a JFIF header, whole (Pillow reads its fields)
            if segment[:5] != b"JFIF\0" or len(segment) < 14:
                return None
        elif marker not in _PLAIN_SEGMENTS:
            return None
        pos += 2 + length
    return None


def _decode_plain(data: bytes, max_pixels: int, min_side: int) -> np.ndarray | None:
    """A plain JPEG (``plain_jpeg``) at full size decoded by simplejpeg, or None: Pillow's
    route decides (another file, a reduced size, anything libjpeg warns about)."""
    if (header := plain_jpeg(data)) is None:
        return None
    height, width, components = header
    check_size(height, width, max_pixels, "declared size of the JPEG")
    if min_side > 0 and draft_scale(width, height, min_side) > 1:
        return None
    return _simplejpeg(data, components == 1, (height, width))


def open_encoded(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """``decode``'s first half: the header parsed and checked (format, declared size, mode), no
    pixel decoded yet; what it costs depends on the bytes, not on the pixels."""
    if not data:
        raise InvalidImage("empty image bytes")
    _allow_in_pillow(max_pixels)
    image = _open(data, max_pixels)
    name = _name(image.format)
    if image.format == "TIFF" and (raw := _camera_raw(data, image)) is not None:
        raise InvalidImage(f"{raw}, not an accepted format: send {FORMAT_NAMES}")
    check_size(image.height, image.width, max_pixels, f"declared size of the {name}")
    if image.format == "TIFF":  # libtiff allocates a whole declared tile, whatever the image
        tile = image.tag_v2.get(TIFF_TILE_WIDTH, 0), image.tag_v2.get(TIFF_TILE_LENGTH, 0)
        if all(isinstance(side, int) and side > 0 for side in tile):  # a tiled TIFF
            check_size(tile[1], tile[0], max_pixels, "declared tile of the TIFF")
    _check_mode(image.mode, name)  # before any pixel is decoded
    return image


TIFF_TILE_WIDTH, TIFF_TILE_LENGTH = 322, 323  # an 8x8 TIFF's 16384^2 tile took 770 MiB
TIFF_NEW_SUBFILE_TYPE, TIFF_DNG_VERSION = 254, 50706


def _camera_raw(data: bytes, image: Image.Image) -> str | None:
    """What a TIFF-structured file whose first image is not the picture is: camera raws (DNG,
    Canon's CR2, Nikon's NEF, Sony's ARW, ...) are TIFF files whose first image is a preview or
    a thumbnail (the raw sensor data, which no decoder here reads, lies elsewhere), so Pillow
    would give a 160-px thumbnail's features as the photo's. None for a plain TIFF."""
    if data[8:11] == b"CR\x02":
        return "Canon CR2 raw file (by its signature)"
    if TIFF_DNG_VERSION in image.tag_v2:
        return "DNG camera raw file (by its DNGVersion tag; its first image is a preview)"
    subfile = image.tag_v2.get(TIFF_NEW_SUBFILE_TYPE, 0)
    if isinstance(subfile, int) and subfile & 0b101:  # bit 0: reduced resolution; 2: a mask
        return (f"TIFF file whose first image is a reduced-resolution copy or a transparency "
                f"mask of another (NewSubfileType {subfile}: a camera raw's thumbnail, as in "
                f"NEF or ARW files)")
    return None


def decode_opened(image: Image.Image, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                  min_side: int = 0) -> np.ndarray:
    """``decode``'s second half, on an image from ``open_encoded``."""
    name = _name(image.format)
    scale = 1
    if min_side > 0 and image.format in ("JPEG", "MPO"):
        scale = draft_scale(image.width, image.height, min_side)
        if scale > 1:  # Pillow picks the largest scale whose size stays >= the one asked for
            image.draft(None, (image.width // scale, image.height // scale))  # mode unchanged
    if scale == 1 and (pixels := _decode_jfif(image, name)) is not None:
        return pixels
    source = getattr(image, "fp", None)  # Pillow lets go of a PNG's file once loaded
    try:
        image.load()  # decodes every pixel: truncated or corrupt data fails here
    except Image.DecompressionBombError as err:
        raise _over_limit(name, err, max_pixels) from None
    except MemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - a decoder error means bad input, not a bug
        reason = f"{type(err).__name__}: {str(err).strip()}"  # libheif's end in a newline
        raise InvalidImage(f"cannot decode {name} image: {reason}") from None
    if image.format == "PNG" and isinstance(source, io.BytesIO) and (
            short := _png_data_short(image, source)):
        raise InvalidImage(f"cannot decode PNG image: {short}")
    return to_rgb(image)


# Adam7's passes: first column and row, column and row steps
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2),
          (0, 1, 1, 2))
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # by colour type


def _png_data_short(image: Image.Image, source: io.BytesIO) -> str | None:
    """Why a PNG's image data holds fewer bytes than its header declares, or None. Pillow fills
    what a zlib stream that ends early leaves with zeros, without a word: a damaged file served
    as another picture. Rows come in order, so the last pixel is then zero bytes: only such a
    PNG has its data counted (one more inflate; a black last pixel is rare in a photo, common in
    a drawing), and every interlaced one (its passes leave pixels apart; Pillow refuses most)."""
    data = source.getvalue()
    interlaced = data[12:16] == b"IHDR" and len(data) > 28 and data[28] != 0
    width, height = image.size
    if not interlaced and any(image.crop((width - 1, height - 1, width, height)).tobytes()):
        return None
    pos, stream, ihdr = 8, zlib.decompressobj(), None
    needed = got = 0
    while pos + 8 <= len(data):
        length, kind = int.from_bytes(data[pos:pos + 4], "big"), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR" and len(body) >= 13 and ihdr is None:  # Pillow reads the first
            ihdr = body
            needed = _png_data_size(*struct.unpack(">IIBB", body[:10]), body[12])
        elif kind == b"IDAT":
            while body and not stream.eof:
                got += len(stream.decompress(body, 1 << 20))
                body = stream.unconsumed_tail
        elif kind == b"IEND":
            break
        pos += 12 + length
    if ihdr is None or got >= needed:
        return None
    return (f"its image data ends early: {got} of the {needed} bytes its {width}x{height} "
            "size needs (Pillow would fill the rest with zeros)")


def _png_data_size(width: int, height: int, depth: int, colour: int, interlace: int) -> int:
    """The inflated size of a PNG's image data: each row's filter byte and its pixels."""
    bits = depth * _PNG_CHANNELS.get(colour, 1)
    passes = _ADAM7 if interlace else ((0, 0, 1, 1),)
    size = 0
    for x0, y0, dx, dy in passes:
        cols, rows = max(0, -(-(width - x0) // dx)), max(0, -(-(height - y0) // dy))
        if cols and rows:
            size += rows * (1 + (cols * bits + 7) // 8)
    return size


def _decode_jfif(image: Image.Image, name: str) -> np.ndarray | None:
    """A plain JPEG (8-bit RGB or grey, no Adobe colour transform, upright) decoded by
    simplejpeg at full size, or None: Pillow decodes it (anything else, or anything libjpeg
    warns about, which simplejpeg's strict mode raises)."""
    if (simplejpeg is None or image.format != "JPEG" or image.mode not in ("RGB", "L")
            or "adobe" in image.info or _orientation(image, name) != 1
            or not isinstance(getattr(image, "fp", None), io.BytesIO)):
        return None
    with image.fp.getbuffer() as data:  # released at once: Pillow may close its file later
        return _simplejpeg(data, image.mode == "L", (image.height, image.width))


def _simplejpeg(data, grey: bool, size: tuple[int, int]) -> np.ndarray | None:
    """simplejpeg's strict decode as uint8 RGB, or None when libjpeg warns or fails, or the
    picture is not the header's size: Pillow's answer (or reason) then stands."""
    try:
        pixels = simplejpeg.decode_jpeg(data, colorspace="GRAY" if grey else "RGB")
    except ValueError:
        return None
    if pixels.shape[:2] != size:
        return None
    return np.repeat(pixels, 3, axis=2) if grey else pixels


def draft_scale(width: int, height: int, min_side: int) -> int:
    """The JPEG DCT scale (8, 4, 2 or 1) for a width x height picture whose resize needs a
    shorter side of ``min_side``: the largest that divides both sides (the reduced pixels then
    cover the picture exactly: no partial pixel shifts the geometry) and keeps both
    >= ``DRAFT_MARGIN`` x ``min_side``."""
    for scale in (8, 4, 2):
        if not (width % scale or height % scale) and (
            min(width, height) >= scale * DRAFT_MARGIN * min_side
        ):
            return scale
    return 1


def to_rgb(image: Image.Image) -> np.ndarray:
    """A PIL image -> upright uint8 [H, W, 3] RGB by the rules above (orientation, colour
    modes, transparency); refuses the modes without an unambiguous mapping by name."""
    name = _name(image.format)
    _check_mode(image.mode, name)
    return _rgb_of(_upright(image, name), name)


def check_size(height: int, width: int, max_pixels: int, what: str = "image") -> None:
    if height <= 0 or width <= 0:
        raise InvalidImage(f"{what} is {width}x{height}: zero-sized")
    if height * width > max_pixels:
        raise InvalidImage(
            f"{what} is {width}x{height} = {height * width} pixels, {_limit(max_pixels)}"
        )


def check_pixel_shape(shape: Sequence[int]) -> None:
    """Raw pixels' shape: [H, W, 3] with H, W > 0 (said in the tensor's order, not as a
    file's WxH); a door checks it before it reads the bytes."""
    if len(shape) != 3 or shape[-1] != 3 or min(shape) < 0:
        got = list(shape) if len(shape) <= 8 else f"{len(shape)} dimensions"
        raise InvalidImage(f"raw pixels must have shape [height, width, 3] (RGB), got {got}")
    if not (shape[0] and shape[1]):
        raise InvalidImage(f"raw pixels of shape {list(shape)} are zero-sized: [height, width, "
                           "3] with both sides at least 1")


def check_pixels(pixels: np.ndarray, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> np.ndarray:
    """Raw pixels must be uint8 [H, W, 3] with H, W > 0; they are used as given."""
    if pixels.dtype != np.uint8:
        raise InvalidImage(f"raw pixels must be uint8, got {pixels.dtype}")
    check_pixel_shape(pixels.shape)
    check_size(pixels.shape[0], pixels.shape[1], max_pixels, "raw image")
    return pixels


# ---- decoding ---------------------------------------------------------------------------------
def _limit(max_pixels: int) -> str:
    return (
        f"over the limit of {max_pixels} (--max-image-pixels of the server or the local job; a "
        "decompression bomb guard)"
    )


_OVER_LIMIT = re.compile(r"(?:(\d+) pixels, )?over the limit of (\d+) \(--max-image-pixels")


def refused_over_limit(reason: str) -> tuple[int | None, int] | None:
    """(the pixels the image declared, when the refusal says it; the limit) of a refusal worded
    by ``_limit``, else None: what a job rerun under a larger limit needs to take it again."""
    found = _OVER_LIMIT.search(reason)
    if found is None:
        return None
    return (int(found[1]) if found[1] else None), int(found[2])


# How refusals for a file's format read (``_unaccepted``, ``_open``), in this version and the
# earlier ones that wrote jobs' errors.jsonl: HEIC and AVIF were refused so before 2026-12-06.
_NAMED_REFUSAL = re.compile(r"(.*?) file \(by its signature\), not an accepted format")
_UNKNOWN_REFUSAL = re.compile(r"not an image file of a known format: .* starting (b'.*'|b\".*\")\)")
_NO_DECODER = "image, but its decoder is not installed"
_ACCEPTED_NAMES = (*FORMAT_NAMES.replace(" or", ",").split(", "), "HEIF")


def refused_for_format(reason: str) -> bool:
    """Whether a refusal was for a file's format and the file may be of a format accepted now:
    one named as such (a HEIC once refused by name; a JPEG XL, which names JPEG, too), one
    refused for want of its decoder, or one of no known format that starts as an ISO media file
    (the family of HEIC and AVIF, refused so before they were named). A job's rerun reads such a
    file's head (``accepted_format``) to take it again; a text file's or a PCX's refusal is not
    worth a read."""
    if _NO_DECODER in reason:
        return True
    if (named := _NAMED_REFUSAL.match(reason)) is not None:
        return any(name in named[1] for name in _ACCEPTED_NAMES)
    if (unknown := _UNKNOWN_REFUSAL.match(reason)) is not None:
        try:
            start = ast.literal_eval(unknown[1])
        except (ValueError, SyntaxError):
            return False
        return isinstance(start, bytes) and start[4:8] == b"ftyp"
    return False


HEAD_BYTES = 4096  # what ``accepted_format`` needs of a file: an ISO file's brands are within


def accepted_format(head: bytes) -> str | None:
    """The accepted format (of ``FORMATS``) a file's first ``HEAD_BYTES`` name by their
    signature, recognised as ``decode`` recognises it, nothing parsed further; else None."""
    for fmt in FORMATS:
        if fmt in _BY_BRANDS:
            if _iso_kind(head) == _BY_BRANDS[fmt]:
                return fmt
        elif _signature(Image.OPEN[fmt][1], head[:16]) is True:
            return fmt
    return None


def _name(fmt: str | None) -> str:
    """How messages name a format; a PIL image built in memory has none."""
    return {"WEBP": "WebP", "MPO": "JPEG (MPO)", "HEIF": "HEIC"}.get(fmt or "", fmt or "in-memory")


def _allow_in_pillow(max_pixels: int) -> None:
    """Raise Pillow's guard (it warns above the value, refuses above twice it) to max_pixels."""
    if Image.MAX_IMAGE_PIXELS is None or Image.MAX_IMAGE_PIXELS >= max_pixels:
        return
    with _PILLOW_GUARD:
        if Image.MAX_IMAGE_PIXELS is not None and Image.MAX_IMAGE_PIXELS < max_pixels:
            Image.MAX_IMAGE_PIXELS = max_pixels


def _over_limit(name: str, err: Exception, max_pixels: int) -> InvalidImage:
    """Pillow's guard refused (it is never below max_pixels): say it in terms of our limit."""
    found = re.search(r"\((\d+) pixels\)", str(err))
    size = f"{found[1]} pixels" if found else "more pixels than allowed"
    return InvalidImage(f"{name} declares a frame or tile of {size}, {_limit(max_pixels)}")


def _open(data: bytes, max_pixels: int) -> Image.Image:
    """Parse the header of an accepted format (no pixels decoded), or say what the bytes are.

    Pillow's plugins are called directly rather than through ``Image.open``, which answers
    every failure with "cannot identify image file": a recognised format's reason is kept.
    """
    prefix = data[:16]
    for fmt in FORMATS:
        if fmt in _BY_BRANDS:  # the ISO brands decide (Pillow's AVIF check takes a HEIC's mif1)
            if _iso_kind(data) != _BY_BRANDS[fmt]:
                continue
            if fmt == "HEIF" and not _heif_reader():
                raise InvalidImage(f"{_name(fmt)} {_NO_DECODER} (pillow-heif, in the "
                                   "vit22b[model] extra)")
        factory, accept = Image.OPEN[fmt]
        recognised = _signature(accept, prefix)
        if fmt in _BY_BRANDS:
            recognised = recognised or True  # and its reader says whether it can read it
        if isinstance(recognised, str):  # the plugin is there but its codec is not
            raise InvalidImage(f"{_name(fmt)} image, but {recognised}")
        if not recognised:
            continue
        try:
            return factory(io.BytesIO(data), "")
        except Image.DecompressionBombError as err:
            raise _over_limit(_name(fmt), err, max_pixels) from None
        except MemoryError:
            raise
        except Exception as err:  # noqa: BLE001 - a header parser failure is the sender's data
            raise InvalidImage(f"{_name(fmt)} file, but {_header_reason(err)}") from None
    raise InvalidImage(_unaccepted(data))


@functools.cache
def _heif_reader() -> bool:
    """Whether HEIC can be read: pillow-heif (libheif and libde265) registered with Pillow at the
    first HEIC, so that a process that never decodes one (the client SDK) neither imports it
    nor has its process-wide settings changed. One decoding thread, as every other format's (the
    server's decode pool is the parallelism); no thumbnails, depth maps or auxiliary images read:
    only the primary image is used, and less of a hostile file is parsed."""
    try:
        import pillow_heif
    except ImportError:  # the model extra installs it
        return False
    pillow_heif.register_heif_opener(decode_threads=1, thumbnails=False, depth_images=False,
                                     aux_images=False)
    return True


def _signature(accept, prefix: bytes):
    """A plugin's signature check; one that fails on a prefix too short for it does not match
    (Pillow's DIB check unpacks 4 bytes of whatever it is given)."""
    try:
        return accept(prefix)
    except Exception:  # noqa: BLE001 - any failure of the check is "not this format"
        return False


def _header_reason(err: Exception) -> str:
    if str(err) == "not identified by this driver":  # Pillow's words for an empty size or mode
        return (
            "its header declares no pixels Pillow can read (a zero width or height, or no known "
            "pixel format)"
        )
    return f"its header is unusable: {type(err).__name__}: {str(err).strip()}"


# What an ISO media file is, by its brands (bytes 8-12 after "ftyp", then the compatible ones):
# AVIF and HEIC (any HEIF image but AVIF: libheif says what it cannot decode) are read; the
# others are named when refused.
_ISO_BRANDS = {
    **dict.fromkeys((b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"hevm", b"hevs",
                     b"mif1", b"msf1"), "HEIC"),
    **dict.fromkeys((b"avif", b"avis"), "AVIF"),
    b"qt  ": "QuickTime (MOV) video",
    **dict.fromkeys((b"isom", b"iso2", b"iso4", b"iso5", b"iso6", b"mp41", b"mp42", b"avc1",
                     b"dash", b"M4V ", b"M4VP", b"MSNV", b"NDAS", b"f4v "), "MP4 video"),
    **dict.fromkeys((b"3gp4", b"3gp5", b"3gp6", b"3g2a"), "3GP video"),
    b"crx ": "Canon CR3 raw",
}
# Other well-known files with a signature at their start, for a refusal that names them.
_OTHER_SIGNATURES = (
    (b"\xff\x0a", "JPEG XL"),
    (b"\x00\x00\x00\x0cJXL \r\n\x87\n", "JPEG XL"),
    (b"\x1a\x45\xdf\xa3", "Matroska or WebM video"),
    (b"%PDF-", "PDF document"),
    (b"PK\x03\x04", "ZIP archive"),
    (b"\x1f\x8b", "gzip archive"),
)


def _iso_kind(data: bytes) -> str | None:
    """An ISO media file's kind by its ``ftyp`` brands: the major one, else the first
    compatible one known, the generic HEIF ones last (a HEIC photo's major brand may be
    ``mif1``, which Pillow's AVIF plugin takes for AVIF; an AVIF's too)."""
    if data[4:8] != b"ftyp":
        return None
    end = min(int.from_bytes(data[:4], "big"), len(data), 4096)
    brands = [data[8:12], *(data[k:k + 4] for k in range(16, end - 3, 4))]
    generic = (b"mif1", b"msf1")  # any HEIF-family image: a specific brand says which
    for brand in [*(b for b in brands if b not in generic), *generic]:
        if brand in brands and brand in _ISO_BRANDS:
            return _ISO_BRANDS[brand]
    return f"ISO media (brand {brands[0].decode('latin-1')!r})"


def _tga_kind(data: bytes) -> str | None:
    """A Targa file has no signature, and its commonest header (uncompressed true colour:
    ``00 00 02 00``) starts as a Windows cursor's does; a cursor's image count (bytes 4-5) is
    at least 1 where a TGA without a colour map has 0 there. So: no colour map, a true-colour
    or grey image type, a bit depth it allows, and a non-empty size."""
    if len(data) < 18 or data[1] != 0 or data[2] not in (2, 3, 10, 11) or data[3:8] != bytes(5):
        return None
    width, height = int.from_bytes(data[12:14], "little"), int.from_bytes(data[14:16], "little")
    return "TGA (Targa)" if width and height and data[16] in (8, 15, 16, 24, 32) else None


def _other_kind(data: bytes) -> str | None:
    """What well-known non-image (or unaccepted image) file the bytes start like, if any."""
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "AVI video"
    for signature, kind in _OTHER_SIGNATURES:
        if data.startswith(signature):
            return kind
    head = data[:1024].lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if head.startswith(b"<svg") or (head.startswith(b"<?xml") and b"<svg" in head):
        return "SVG (vector) image"
    return None


def _unaccepted(data: bytes) -> str:
    """The reason for bytes of no accepted format: another format Pillow knows, a well-known
    one it does not (JPEG XL, a video, a PDF, ...), or none."""
    prefix, kind = data[:16], _iso_kind(data) or _tga_kind(data)  # before Pillow's guesses
    for fmt in Image.ID if kind is None else ():
        factory, accept = Image.OPEN[fmt]
        if fmt not in FORMATS and accept is not None and _signature(accept, prefix) is True:
            description = getattr(factory, "format_description", None)
            named = f"{fmt} ({description})" if description else fmt
            return f"{named} file (by its signature), not an accepted format: send {FORMAT_NAMES}"
    if (kind := kind or _other_kind(data)) is not None:
        return f"{kind} file (by its signature), not an accepted format: send {FORMAT_NAMES}"
    return (
        f"not an image file of a known format: no {FORMAT_NAMES} signature "
        f"({len(data)} bytes starting {data[:8]!r})"
    )


def _check_mode(mode: str, name: str) -> None:
    if mode in _REFUSED:
        raise InvalidImage(
            f"{name} image in mode {mode}: {_REFUSED[mode]}; save it as 8- or 16-bit RGB or grey"
        )


def _orientation(image: Image.Image, name: str):
    """The EXIF orientation (Pillow's getexif reads XMP's too when EXIF has none; 1: upright)."""
    try:
        return image.getexif().get(ExifTags.Base.Orientation, 1)
    except Exception as err:  # noqa: BLE001 - malformed metadata: the orientation is unknown
        raise InvalidImage(
            f"{name} image with unreadable EXIF metadata (its orientation is unknown): "
            f"{type(err).__name__}: {err}"
        ) from None


def _upright(image: Image.Image, name: str) -> Image.Image:
    """Apply the EXIF orientation; a HEIF image is upright from its decoder (``irot``/``imir``),
    and the EXIF orientation a phone writes beside those boxes must not turn it again."""
    if image.format == "HEIF":
        return image
    method = _ORIENTATION.get(_orientation(image, name))
    return image if method is None else image.transpose(method)


def _rgb_of(image: Image.Image, name: str) -> np.ndarray:
    mode = image.mode
    if mode in _SIXTEEN_BIT:
        values = np.asarray(image)
        grey = np.empty(values.shape, np.uint8)
        for band in _bands(values.shape):  # round(v / 257), no ties
            grey[band] = (values[band].astype(np.uint32) * 255 + 32767) // 65535
        rgb = np.repeat(grey[..., None], 3, axis=2)
        if isinstance(image.info.get("transparency"), int):  # PNG tRNS: one transparent grey
            rgb[values == image.info["transparency"]] = BACKGROUND
        return rgb
    if mode in ("La", "RGBa"):  # premultiplied alpha: colour already scaled by alpha
        pixels = np.asarray(image)
        colour = pixels[..., :1].repeat(3, axis=2) if mode == "La" else pixels[..., :3]
        return _over_background(colour, pixels[..., -1:], premultiplied=True)
    if image.has_transparency_data:  # LA, PA, RGBA, or a tRNS / GIF transparent colour
        rgba = np.asarray(image.convert("RGBA"))
        return _over_background(rgba[..., :3], rgba[..., 3:], premultiplied=False)
    if mode == "RGB":
        return np.asarray(image)
    if mode in _EXPANDED:
        return np.asarray(image.convert("RGB"))
    raise InvalidImage(f"{name} image in mode {mode}: not a supported pixel mode")


def _over_background(colour: np.ndarray, alpha: np.ndarray, premultiplied: bool) -> np.ndarray:
    """Composite over BACKGROUND, rounded to the nearest level (no ties: 255 is odd)."""
    out = np.empty(colour.shape, np.uint8)
    for band in _bands(colour.shape):
        a = alpha[band].astype(np.uint32)
        weighted = colour[band].astype(np.uint32) * (255 if premultiplied else a)
        weighted += np.asarray(BACKGROUND, np.uint32) * (255 - a) + 127
        out[band] = np.minimum(weighted // 255, 255)
    return out


BAND_PIXELS = 1 << 20


def _bands(shape: tuple[int, ...]) -> list[slice]:
    """Rows in bands of about ``BAND_PIXELS``: the 32-bit arithmetic of a whole image would hold
    several 4-byte copies of it (a 6000 x 6000 RGBA PNG composited whole took 2 GB)."""
    step = max(1, BAND_PIXELS // max(1, shape[1]))
    return [slice(top, top + step) for top in range(0, shape[0], step)]


# ---- geometry, resize, crop, normalise -------------------------------------------------------
@dataclass(frozen=True)
class Geometry:
    """What an image is resized to (a request chooses it; the contract's hash covers it).

    Square (``dense`` False): a ``resolution`` x ``resolution`` input made by the model's own
    rule: the shorter side resized (both sides where ``Preprocess.keep_aspect`` is False; scaled
    by the preset's resize / crop ratio) and the centre crop, or, for a contract without a crop
    (``Preprocess.crop`` False), both sides resized.
    Dense: the aspect ratio kept, no crop: the shorter side to about ``resolution``, each side
    rounded to a whole number of patches (at least one), then both shrunk together while the
    grid holds more than ``max_patches`` patches (0: no bound).
    ``resolution`` 0 means the model's image size.
    """

    resolution: int = 0
    dense: bool = False
    max_patches: int = 0

    def resolved(self, cfg: ViTConfig) -> Geometry:
        return replace(self, resolution=self.resolution or cfg.image_size)

    def key(self, cfg: ViTConfig) -> dict | None:
        """What the preprocessing hash adds for this geometry: None for the model's own input
        (hashes from before geometries existed stay)."""
        g = self.resolved(cfg)
        if not g.dense and g.resolution == cfg.image_size:
            return None
        return {"resolution": g.resolution, "dense": g.dense, "max_patches": g.max_patches}

    def label(self, cfg: ViTConfig) -> str:
        g = self.resolved(cfg)
        bound = f", at most {g.max_patches} patches" if g.max_patches else ""
        return f"dense {g.resolution}{bound}" if g.dense else f"{g.resolution}x{g.resolution}"

    def size(self, cfg: ViTConfig, height: int, width: int) -> tuple[int, int]:
        """The (height, width) in pixels the model sees for a height x width image."""
        g = self.resolved(cfg)
        if not g.dense:
            return g.resolution, g.resolution
        p, short = cfg.patch, min(height, width)
        rows = max(1, round(height * g.resolution / short / p))
        cols = max(1, round(width * g.resolution / short / p))
        if g.max_patches and rows * cols > g.max_patches:
            factor = math.sqrt(g.max_patches / (rows * cols))
            rows, cols = max(1, math.floor(rows * factor)), max(1, math.floor(cols * factor))
            while rows * cols > g.max_patches:  # a side held at one patch
                rows, cols = (rows - 1, cols) if rows > cols else (rows, cols - 1)
        return rows * p, cols * p


OWN_GEOMETRY = Geometry()  # the model's own square input


def normalise_formula(pixels: np.ndarray, p) -> np.ndarray:
    """The contract's normalisation, x / 255 then (x - mean) / std per channel, in float32."""
    mean = np.asarray(p.mean, np.float32)
    std = np.asarray(p.std, np.float32)
    return (pixels.astype(np.float32) / np.float32(255.0) - mean) / std


@functools.lru_cache(maxsize=64)
def level_table(p: Preprocess) -> np.ndarray:
    """[3, 256] float32, read-only: ``normalise_formula`` at every uint8 level of each channel.

    The normalisation is applied by looking levels up in it, on the host
    (``Preprocessor.normalise``) and inside the compiled forward (``model.forward.from_levels``:
    the server sends the device uint8 levels, a quarter of the bytes). Both give the formula's
    own float32 values bit for bit; XLA would compile the formula itself into a multiplication
    by 1/255 and by 1/std, which rounds differently."""
    levels = np.arange(256, dtype=np.uint8)[:, None].repeat(3, axis=1)
    table = np.ascontiguousarray(normalise_formula(levels, p).T)
    table.flags.writeable = False
    return table


@dataclass(frozen=True)
class Preprocessor:
    """uint8 RGB pixels -> float32 [H, W, 3] at the geometry: resize (and centre crop),
    normalise (the server: ``crop`` here, the normalisation in the forward)."""

    cfg: ViTConfig
    geometry: Geometry = OWN_GEOMETRY

    def __post_init__(self) -> None:
        if self.cfg.preprocess.resize < self.cfg.image_size and self.cfg.preprocess.crop:
            raise ValueError(
                f"{self.cfg.name}: preprocess.resize={self.cfg.preprocess.resize} is smaller "
                f"than image_size={self.cfg.image_size}; the centre crop would not fit"
            )
        object.__setattr__(self, "geometry", self.geometry.resolved(self.cfg))
        if self.geometry.resolution % self.cfg.patch and not self.geometry.dense:
            raise ValueError(
                f"{self.cfg.name}: resolution {self.geometry.resolution} is not a multiple of "
                f"the patch ({self.cfg.patch})"
            )

    @functools.cached_property
    def hash(self) -> str:
        return self.cfg.preprocess_hash(self.geometry.key(self.cfg))

    @property
    def resize(self) -> int:
        """The shorter side before the centre crop at this resolution (the preset's ratio)."""
        p, size = self.cfg.preprocess, self.geometry.resolution
        if size == self.cfg.image_size:
            return p.resize
        return int(round(p.resize * size / self.cfg.image_size))

    @property
    def min_side(self) -> int:
        """The shorter side a decoded image needs so that the resize never upsamples it (the
        crop mode's resize; the resolution for squash and dense)."""
        g = self.geometry
        return g.resolution if g.dense or not self.cfg.preprocess.crop else self.resize

    def describe(self) -> str:
        p, g = self.cfg.preprocess, self.geometry
        if g.dense:
            bound = f", shrunk to at most {g.max_patches} patches" if g.max_patches else ""
            geometry = (
                f"dense: aspect ratio kept, no crop; the shorter side to about {g.resolution}, "
                f"each side rounded to a whole number of {self.cfg.patch}-pixel patches{bound} "
                f"({p.interpolation}, PIL, antialiased)"
            )
            out = "float32 [height, width, 3] (the grid in the response)"
        elif not p.crop:
            geometry = (
                f"resize both sides to {g.resolution}x{g.resolution} ({p.interpolation}, PIL, "
                "antialiased; no crop)"
            )
            out = f"float32 [{g.resolution}, {g.resolution}, 3]"
        else:
            size = g.resolution
            resize = (f"the shorter side to {self.resize}" if p.keep_aspect else
                      f"both sides to {self.resize}x{self.resize}")
            scaled = "longer side floor-scaled; " if p.keep_aspect else "aspect ratio not kept; "
            geometry = (
                f"resize {resize} ({p.interpolation}, PIL, "
                f"antialiased; {scaled}past {FULL_RESIZE_CROPS} crops' worth "
                f"of pixels only the crop's source box is resampled); centre crop {size}x{size}"
                f" (offset (resized - {size}) / 2, "
                f"{'floored' if p.crop_offset == 'floor' else 'rounded half to even'})"
            )
            out = f"float32 [{size}, {size}, 3]"
        return (
            f"pixel rules v{PIXEL_RULES}: decode ({FORMAT_NAMES.replace(' or', ',')}; first "
            f"frame (HEIC: its primary image); EXIF orientation applied (HEIC: its irot/imir "
            f"boxes); 16-bit grey scaled by 255/65535; transparency "
            f"over RGB {BACKGROUND}; modes I, F and LAB refused; JPEG decoded at the largest "
            f"DCT scale of 1/2, 1/4, 1/8 that divides both sides and keeps both >= "
            f"{DRAFT_MARGIN} x {self.min_side}) -> RGB; raw uint8 pixels as given; {geometry}; "
            f"x/255; (x - mean) / std per channel with mean={list(p.mean)} std={list(p.std)}; "
            f"{out}"
        )

    def crop(self, pixels: np.ndarray) -> np.ndarray:
        """Resize (and centre-crop): uint8 [H, W, 3] -> uint8 at the geometry's size."""
        p, g = self.cfg.preprocess, self.geometry
        height, width = pixels.shape[:2]
        if g.dense or not p.crop:
            out_h, out_w = g.size(self.cfg, height, width) if g.dense else (g.resolution,) * 2
            if (out_h, out_w) == (height, width):
                return pixels
            image = Image.fromarray(pixels)
            return np.asarray(image.resize((out_w, out_h), _RESAMPLE[p.interpolation]))
        size, resize = g.resolution, self.resize
        short = min(height, width)
        new_h = resize if height == short or not p.keep_aspect else int(resize * height / short)
        new_w = resize if width == short or not p.keep_aspect else int(resize * width / short)
        top, left = self._offset(new_h - size), self._offset(new_w - size)
        if (new_h, new_w) == (height, width):
            return pixels[top : top + size, left : left + size]
        image, resample = Image.fromarray(pixels), _RESAMPLE[p.interpolation]
        if new_h * new_w <= FULL_RESIZE_CROPS * size * size:
            resized = np.asarray(image.resize((new_w, new_h), resample))
            return resized[top : top + size, left : left + size]
        # A 1x100000 strip would resize to 64 x 6.4M: resample the crop's source box alone.
        y_scale, x_scale = height / new_h, width / new_w
        box = (left * x_scale, top * y_scale, (left + size) * x_scale, (top + size) * y_scale)
        return np.asarray(image.resize((size, size), resample, box=box))

    def _offset(self, margin: int) -> int:
        """The centre crop's start in a side ``margin`` pixels longer than the crop."""
        if self.cfg.preprocess.crop_offset == "floor":
            return margin // 2
        return int(round(margin / 2.0))

    def normalise(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 -> float32 by table look-up (``level_table``): the formula's own float32 values
        (bit for bit), 1.5x faster than computing them at 64x64 and 1.8x at 224x224
        (``serve_parts.py``). The server leaves this step to the compiled forward."""
        out, table = np.empty(pixels.shape, np.float32), level_table(self.cfg.preprocess)
        for channel in range(3):
            np.take(table[channel], pixels[..., channel], out=out[..., channel])
        return out

    def __call__(self, pixels: np.ndarray) -> np.ndarray:
        return self.normalise(self.crop(pixels))

    def load(self, image: bytes | np.ndarray, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
             draft: bool = True):
        """Encoded bytes or raw uint8 pixels -> the model input (``draft`` False: a JPEG
        decoded at full size, outside the contract: for measuring what reduced-size decoding
        changes)."""
        if isinstance(image, (bytes, bytearray, memoryview)):
            return self(decode(bytes(image), max_pixels, self.min_side if draft else 0))
        return self(check_pixels(np.asarray(image), max_pixels))
