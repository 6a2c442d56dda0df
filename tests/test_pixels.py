"""The pixel contract on real files: formats, colour modes, orientation, limits, the crop window.

Every expected image is computed here in numpy from the file's own definition (palette lookups,
16-bit scaling, alpha compositing, the EXIF orientation table), not by the code under test.
"""

from __future__ import annotations

import io
import re
import struct
import subprocess
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import photos
import pytest
from photos import photo, photo_jpeg
from PIL import Image
from vit22b.model import get_config
from vit22b.model import pixels as contract
from vit22b.model.config import PIXEL_RULES, ViTConfig
from vit22b.model.errors import InvalidImage
from vit22b.model.pixels import (
    BACKGROUND,
    DRAFT_MARGIN,
    FULL_RESIZE_CROPS,
    Preprocessor,
    decode,
    draft_scale,
    normalise_formula,
    plain_jpeg,
)

RNG = np.random.default_rng(0)
WHITE = np.asarray(BACKGROUND, np.float64)


def encode(image: Image.Image, fmt: str, **params) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **params)
    return buffer.getvalue()


def rgb(height: int = 20, width: int = 30, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def over_white(colour: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    a = alpha.astype(np.float64)[..., None] / 255
    return np.round(colour * a + WHITE * (1 - a)).astype(np.uint8)


@pytest.fixture(params=["whole", "bands"])
def bands(request, monkeypatch):
    """The integer arithmetic on a whole image, and in bands of 3 rows of 9 (27 pixels: the
    images below split into ragged bands): the same pixels either way."""
    if request.param == "bands":
        monkeypatch.setattr(contract, "BAND_PIXELS", 27)


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_by_hand(width: int, height: int, depth: int, colour: int, rows: bytes = b"",
                interlace: int = 0) -> bytes:
    header = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, interlace)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header)
            + png_chunk(b"IDAT", zlib.compress(rows)) + png_chunk(b"IEND", b""))


def tiff_tag(data: bytes, tag: int, value: int) -> bytes:
    """Set a SHORT/LONG tag's value in the first IFD of a little-endian TIFF."""
    out = bytearray(data)
    ifd = struct.unpack("<I", out[4:8])[0]
    for k in range(struct.unpack("<H", out[ifd : ifd + 2])[0]):
        entry = ifd + 2 + 12 * k
        found, kind = struct.unpack("<HH", out[entry : entry + 4])
        if found == tag:
            packed = struct.pack("<HH", value, 0) if kind == 3 else struct.pack("<I", value)
            out[entry + 8 : entry + 12] = packed
            return bytes(out)
    raise AssertionError(f"tag {tag} not in the TIFF")


# ---- formats ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt, params", [("PNG", {}), ("BMP", {}), ("TIFF", {}),
                                         ("TIFF", {"compression": "tiff_lzw"}),
                                         ("WEBP", {"lossless": True})])
def test_lossless_formats_decode_to_their_pixels(fmt, params):
    pixels = rgb()
    np.testing.assert_array_equal(decode(encode(Image.fromarray(pixels), fmt, **params)), pixels)


def test_jpeg_decodes_close_to_its_pixels():
    pixels = np.repeat(np.linspace(0, 255, 30, dtype=np.uint8)[None, :, None], 20, 0).repeat(3, 2)
    got = decode(encode(Image.fromarray(pixels), "JPEG", quality=95))
    assert got.shape == (20, 30, 3) and np.abs(got.astype(int) - pixels).mean() < 2


def test_gif_is_its_palette_lookup_and_the_first_frame():
    indices = RNG.integers(0, 16, (12, 10), dtype=np.uint8)
    palette = RNG.integers(0, 256, (256, 3), dtype=np.uint8)
    frame = Image.fromarray(indices, mode="P")
    frame.putpalette(palette.tobytes())
    second = Image.fromarray(np.full((12, 10), 3, np.uint8), mode="P")
    second.putpalette(palette.tobytes())
    data = encode(frame, "GIF", save_all=True, append_images=[second], optimize=False)
    assert Image.open(io.BytesIO(data)).n_frames == 2
    np.testing.assert_array_equal(decode(data), palette[indices])


def test_multipage_tiff_is_its_first_page():
    first, second = rgb(seed=1), rgb(seed=2)
    data = encode(Image.fromarray(first), "TIFF", save_all=True,
                  append_images=[Image.fromarray(second)])
    np.testing.assert_array_equal(decode(data), first)


@pytest.mark.parametrize("fmt, named", [("ICO", "ICO (Windows Icon)"), ("PPM", "PPM (Pbmplus"),
                                        ("PCX", "PCX (Paintbrush)"), ("JPEG2000", "JPEG2000")])
def test_other_formats_are_refused_by_name(fmt, named):
    try:
        data = encode(Image.fromarray(rgb()), fmt)
    except (OSError, KeyError):
        pytest.skip(f"this Pillow cannot write {fmt}")
    with pytest.raises(InvalidImage, match="not an accepted format") as info:
        decode(data)
    assert named in str(info.value) and contract.FORMAT_NAMES in str(info.value)


@pytest.mark.parametrize("data, named", [
    (b"\xff\x0a\xfa\x7f" + bytes(64), "JPEG XL"),
    (b"\x00\x00\x00\x0cJXL \r\n\x87\n" + bytes(64), "JPEG XL"),
    (b"\x00\x00\x00\x20ftypisom\x00\x00\x02\x00isomiso2" + bytes(64), "MP4 video"),
    (b"\x00\x00\x00\x14ftypqt  \x00\x00\x00\x00" + bytes(64), "QuickTime (MOV) video"),
    (b"\x1a\x45\xdf\xa3\x9f\x42\x86\x81\x01" + bytes(64), "Matroska or WebM video"),
    (b"RIFF\x00\x10\x00\x00AVI LIST" + bytes(64), "AVI video"),
    (b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n" + bytes(64), "PDF document"),
    (b'\xef\xbb\xbf<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg"/>',
     "SVG (vector) image"),
    (b"PK\x03\x04\x14\x00" + bytes(64), "ZIP archive"),
    (b"\x1f\x8b\x08\x00" + bytes(64), "gzip archive"),
    (b"\x00\x00\x02\x00\x00\x00\x00\x00\x00\x00\x00\x00<\x00(\x00\x18\x00" + bytes(64),
     "TGA (Targa)"),  # its commonest header begins as a Windows cursor's
    (b"\x00\x00\x00\x18ftypabcd" + bytes(64), "ISO media (brand 'abcd')"),
], ids=lambda x: None if isinstance(x, bytes) else x.split(" ")[0])
def test_well_known_files_pillow_does_not_read_are_refused_by_name(data, named):
    """A folder of a user's files holds videos, PDFs, JPEG XL images: the refusal names
    what the file is, not only that it is no accepted format."""
    with pytest.raises(InvalidImage) as info:
        decode(data)
    assert str(info.value) == (f"{named} file (by its signature), not an accepted format: "
                               f"send {contract.FORMAT_NAMES}")


def _tiff_with(tags: dict, size: tuple[int, int] = (16, 12)) -> bytes:
    from PIL import TiffImagePlugin

    info = TiffImagePlugin.ImageFileDirectory_v2()
    for tag, value in tags.items():
        info[tag] = value
        if isinstance(value, bytes):
            info.tagtype[tag] = 1  # BYTE, as DNGVersion is
    return encode(Image.new("RGB", size, (90, 120, 30)), "TIFF", tiffinfo=info)


def _cr2_like(width: int = 4, height: int = 3) -> bytes:
    """A grey 8-bit TIFF in Canon's CR2 layout: TIFF's header, then "CR", version 2 and the raw
    IFD's offset (here 0), its first IFD at 16 (a CR2's is a preview)."""
    entries = [(256, 3, width), (257, 3, height), (258, 3, 8), (259, 3, 1), (262, 3, 1),
               (273, 4, 0), (277, 3, 1), (278, 3, height), (279, 4, width * height)]
    ifd_size = 2 + 12 * len(entries) + 4
    pixels_at = 16 + ifd_size
    ifd = struct.pack("<H", len(entries))
    for tag, kind, value in entries:
        value = pixels_at if tag == 273 else value
        packed = struct.pack("<HI", value, 0)[:4] if kind == 3 else struct.pack("<I", value)
        ifd += struct.pack("<HHI", tag, kind, 1) + packed
    ifd += struct.pack("<I", 0)
    header = b"II*\x00" + struct.pack("<I", 16) + b"CR\x02\x00" + struct.pack("<I", 0)
    return header + ifd + bytes(range(width * height))


@pytest.mark.parametrize("tags, named", [
    ({50706: b"\x01\x04\x00\x00", 254: 1}, "DNG camera raw file (by its DNGVersion tag"),
    ({50706: b"\x01\x06\x00\x00"}, "DNG camera raw file (by its DNGVersion tag"),
    ({254: 1, 271: "NIKON CORPORATION"}, "TIFF file whose first image is a reduced-resolution"),
    ({254: 4}, "TIFF file whose first image is a reduced-resolution copy or a transparency mask"),
], ids=["dng-preview-first", "dng", "nef-like", "mask-first"])
def test_camera_raws_are_refused_not_read_as_their_thumbnail(tags, named):
    """Camera raws are TIFF files whose first image is a thumbnail or preview: read as TIFF,
    a photographer's DNG gave its 256-px preview's features as the photo's, without a word."""
    with pytest.raises(InvalidImage) as info:
        decode(_tiff_with(tags))
    assert str(info.value).startswith(named)
    assert str(info.value).endswith(f"not an accepted format: send {contract.FORMAT_NAMES}")
    with pytest.raises(InvalidImage, match=r"^Canon CR2 raw file \(by its signature\)"):
        decode(_cr2_like())
    # a plain TIFF, and one whose first image says it is the full-resolution one, are read;
    # so is the CR2-like file with its signature cleared (the file is well formed)
    for plain in (_tiff_with({}), _tiff_with({254: 0}), _tiff_with({254: 2})):
        assert decode(plain).shape == (12, 16, 3)
    plain = _cr2_like().replace(b"CR\x02\x00", bytes(4), 1)
    grey = np.arange(12, dtype=np.uint8).reshape(3, 4)
    np.testing.assert_array_equal(decode(plain), np.repeat(grey[..., None], 3, axis=2))


def test_bytes_of_no_format_say_so():
    with pytest.raises(InvalidImage, match="not an image file of a known format"):
        decode(b"this is text, not an image")
    with pytest.raises(InvalidImage, match="empty image bytes"):
        decode(b"")
    for short in (b"a", b"ab", b"abc", b"\x00\x01\x02"):  # shorter than some signatures
        with pytest.raises(InvalidImage, match="not an image file of a known format"):
            decode(short)


def _zero_sized() -> dict[str, bytes]:
    jpeg = bytearray(encode(Image.fromarray(rgb()), "JPEG"))
    sof = jpeg.find(b"\xff\xc0")
    jpeg[sof + 5 : sof + 9] = bytes(4)  # height and width
    bmp = bytearray(encode(Image.fromarray(rgb()), "BMP"))
    bmp[18:26] = bytes(8)
    tiff = tiff_tag(encode(Image.fromarray(rgb()), "TIFF"), 256, 0)  # ImageWidth
    return {"PNG": png_by_hand(0, 0, 8, 2), "JPEG": bytes(jpeg), "BMP": bytes(bmp), "TIFF": tiff}


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "BMP", "TIFF"])
def test_zero_sized_files_of_a_known_format_say_so(fmt):
    with pytest.raises(InvalidImage) as info:
        decode(_zero_sized()[fmt])
    assert str(info.value).startswith(f"{fmt} file, but its header declares no pixels")
    assert "zero width or height" in str(info.value)


def test_known_format_with_a_broken_header_names_the_format_and_the_reason():
    with pytest.raises(InvalidImage, match=r"^PNG file, but its header declares no pixels"):
        decode(png_by_hand(4, 4, 3, 2))  # bit depth 3 does not exist
    with pytest.raises(InvalidImage, match=r"^BMP file, but its header is unusable: .*depth"):
        bmp = bytearray(encode(Image.fromarray(rgb()), "BMP"))
        bmp[28:30] = struct.pack("<H", 7)  # 7 bits per pixel
        decode(bytes(bmp))
    truncated = encode(Image.fromarray(rgb(64, 64)), "PNG")
    with pytest.raises(InvalidImage, match="cannot decode PNG image"):
        decode(truncated[: len(truncated) // 2])


def test_a_png_whose_image_data_ends_early_is_refused_not_filled_with_black():
    """A PNG whose zlib stream is whole but holds 2 of the 64 rows its header declares: Pillow
    filled the other 62 with zeros without a word, and the server answered 200 with the
    features of another picture (an outside tester's HTTP sweep). Refused; a PNG that ends in
    black rows of its own is still read, whatever its mode or interlacing."""
    grey = b"".join(b"\x00" + bytes([200]) * 64 * 3 for _ in range(2))
    with pytest.raises(InvalidImage, match=r"cannot decode PNG image: its image data ends "
                                           r"early: 386 of the 12352 bytes its 64x64 size needs"):
        decode(png_by_hand(64, 64, 8, 2, grey))
    whole = b"".join(b"\x00" + bytes([200]) * 64 * 3 for _ in range(62)) + b"\x00" * 386
    assert decode(png_by_hand(64, 64, 8, 2, whole))[-1].max() == 0  # its own black rows
    # the stream ending inside the last row (Pillow's own refusal: it wanted the row's end)
    with pytest.raises(InvalidImage, match="cannot decode PNG image"):
        decode(png_by_hand(64, 64, 8, 2, ((b"\x00" + bytes([200]) * 192) * 64)[:-10]))
    # one row, interlaced: Adam7's last pass is empty, its sixth (every other pixel) missing
    passes = b"".join(b"\x00" + bytes([90]) * 3 * n for n in (1, 1, 2, 4))  # 1, 2, 4, 6
    with pytest.raises(InvalidImage, match="ends early: 15 of the 28 bytes its 8x1 size"):
        decode(png_by_hand(8, 1, 8, 2, passes[:-13], interlace=1))
    assert decode(png_by_hand(8, 1, 8, 2, passes, interlace=1)).max() == 90
    for mode in ("RGB", "RGBA", "LA", "P", "I;16", "1"):
        for interlace in (0, 1):
            dark = Image.new(mode, (37, 29))
            data = encode(dark, "PNG", interlace=interlace) if interlace else encode(dark, "PNG")
            assert decode(data).shape == (29, 37, 3), (mode, interlace)
    assert decode(encode(Image.new("RGB", (5, 1)), "PNG")).shape == (1, 5, 3)


# ---- colour modes ----------------------------------------------------------------------------
def test_bilevel_and_grey():
    bits = RNG.integers(0, 2, (9, 13)).astype(bool)
    np.testing.assert_array_equal(decode(encode(Image.fromarray(bits), "PNG")),
                                  np.repeat((bits * 255).astype(np.uint8)[..., None], 3, 2))
    grey = RNG.integers(0, 256, (9, 13), dtype=np.uint8)
    for fmt in ("PNG", "TIFF", "BMP"):
        got = decode(encode(Image.fromarray(grey), fmt))
        np.testing.assert_array_equal(got, np.repeat(grey[..., None], 3, 2))


@pytest.mark.parametrize("fmt, mode", [("PNG", "I;16"), ("TIFF", "I;16"), ("TIFF", "I;16B")])
def test_16_bit_grey_is_scaled_not_clipped(fmt, mode, bands):
    values = RNG.integers(0, 65536, (17, 11)).astype(np.uint16)
    values[0, :4] = [0, 128, 65407, 65535]  # the ends and the rounding points of /257
    raw = values.astype(">u2" if mode == "I;16B" else "<u2").tobytes()
    data = encode(Image.frombytes(mode, values.shape[::-1], raw), fmt)
    assert Image.open(io.BytesIO(data)).mode == mode
    want = np.round(values / 257.0).astype(np.uint8)
    np.testing.assert_array_equal(decode(data), np.repeat(want[..., None], 3, 2))


def test_16_bit_grey_with_a_transparent_value():
    values = RNG.integers(0, 65536, (6, 7)).astype(np.uint16)
    values[2, 3] = 1000
    data = encode(Image.fromarray(values), "PNG", transparency=1000)
    want = np.repeat(np.round(values / 257.0).astype(np.uint8)[..., None], 3, 2)
    want[values == 1000] = BACKGROUND
    np.testing.assert_array_equal(decode(data), want)


def test_16_bit_colour_png_keeps_the_high_byte():
    values = RNG.integers(0, 65536, (5, 6, 3)).astype(">u2")
    rows = b"".join(b"\0" + row.tobytes() for row in values)
    got = decode(png_by_hand(6, 5, 16, 2, rows))
    np.testing.assert_array_equal(got, (values >> 8).astype(np.uint8))


@pytest.mark.parametrize("fmt", ["PNG", "TIFF", "WEBP"])
def test_alpha_is_composited_over_the_background(fmt, bands):
    rgba = rgb(8, 9, seed=3)
    alpha = RNG.integers(0, 256, (8, 9), dtype=np.uint8)
    alpha[0, :3] = [0, 255, 128]
    data = encode(Image.fromarray(np.dstack([rgba, alpha])), fmt, **(
        {"lossless": True, "exact": True} if fmt == "WEBP" else {}))
    np.testing.assert_array_equal(decode(data), over_white(rgba, alpha))


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_grey_with_alpha(fmt):
    grey, alpha = (RNG.integers(0, 256, (8, 9), dtype=np.uint8) for _ in range(2))
    data = encode(Image.fromarray(np.dstack([grey, alpha]), mode="LA"), fmt)
    np.testing.assert_array_equal(decode(data), over_white(np.dstack([grey] * 3), alpha))


def test_premultiplied_grey_alpha_tiff(bands):
    grey, alpha = (RNG.integers(0, 256, (8, 9), dtype=np.uint8) for _ in range(2))
    premultiplied = np.round(grey * (alpha / 255.0)).astype(np.uint8)
    data = encode(Image.fromarray(np.dstack([premultiplied, alpha]), mode="LA"), "TIFF")
    data = tiff_tag(data, 338, 1)  # ExtraSamples: associated (premultiplied) alpha
    assert Image.open(io.BytesIO(data)).mode == "La"
    want = np.round(premultiplied + WHITE[0] * (1 - alpha / 255.0)).clip(0, 255).astype(np.uint8)
    np.testing.assert_array_equal(decode(data), np.repeat(want[..., None], 3, 2))


@pytest.mark.parametrize("fmt", ["PNG", "GIF"])
def test_palette_with_a_transparent_index(fmt):
    indices = RNG.integers(0, 8, (10, 12), dtype=np.uint8)
    palette = RNG.integers(0, 256, (256, 3), dtype=np.uint8)
    image = Image.fromarray(indices, mode="P")
    image.putpalette(palette.tobytes())
    data = encode(image, fmt, transparency=5)
    want = palette[indices]
    want[indices == 5] = BACKGROUND
    np.testing.assert_array_equal(decode(data), want)


def test_palette_with_per_entry_alpha_png():
    indices = RNG.integers(0, 8, (10, 12), dtype=np.uint8)
    palette = RNG.integers(0, 256, (256, 3), dtype=np.uint8)
    alphas = RNG.integers(0, 256, 8, dtype=np.uint8)
    image = Image.fromarray(indices, mode="P")
    image.putpalette(palette.tobytes())
    data = encode(image, "PNG", transparency=alphas.tobytes())  # a tRNS chunk: alpha per entry
    np.testing.assert_array_equal(decode(data), over_white(palette[indices], alphas[indices]))


def test_palette_with_alpha_tiff():
    indices, alpha = RNG.integers(0, 8, (6, 7), dtype=np.uint8), RNG.integers(0, 256, (6, 7),
                                                                               dtype=np.uint8)
    palette = RNG.integers(0, 256, (256, 3), dtype=np.uint8)
    image = Image.fromarray(np.dstack([indices, alpha]), mode="LA")
    image = Image.frombytes("PA", image.size, image.tobytes())
    image.putpalette(palette.tobytes())
    data = encode(image, "TIFF")
    assert Image.open(io.BytesIO(data)).mode == "PA"
    np.testing.assert_array_equal(decode(data), over_white(palette[indices], alpha))


def test_grey_and_rgb_with_a_transparent_colour():
    grey = RNG.integers(0, 4, (6, 7), dtype=np.uint8)
    want = np.repeat(grey[..., None], 3, 2)
    want[grey == 2] = BACKGROUND
    np.testing.assert_array_equal(decode(encode(Image.fromarray(grey), "PNG", transparency=2)),
                                  want)
    colour = RNG.integers(0, 2, (6, 7, 3), dtype=np.uint8)
    want = colour.copy()
    want[(colour == (1, 0, 1)).all(-1)] = BACKGROUND
    data = encode(Image.fromarray(colour), "PNG", transparency=(1, 0, 1))
    np.testing.assert_array_equal(decode(data), want)


def test_cmyk_tiff_is_the_naive_conversion():
    cmyk = RNG.integers(0, 256, (7, 8, 4), dtype=np.uint8)
    cmyk[0, :3] = [[0, 0, 0, 0], [255, 255, 255, 255], [0, 128, 255, 64]]
    data = encode(Image.fromarray(cmyk, mode="CMYK"), "TIFF")
    c, k = cmyk[..., :3].astype(np.float64), cmyk[..., 3:].astype(np.float64)
    want = (255 - c) * (255 - k) / 255
    assert np.abs(decode(data).astype(np.float64) - want).max() <= 1


def test_ycbcr_tiff_is_the_jfif_conversion():
    ycc = RNG.integers(0, 256, (7, 8, 3), dtype=np.uint8)
    data = encode(Image.fromarray(ycc, mode="YCbCr"), "TIFF")
    assert Image.open(io.BytesIO(data)).mode == "YCbCr"
    y, cb, cr = (ycc[..., i].astype(np.float64) for i in range(3))
    want = np.stack([y + 1.402 * (cr - 128), y - 0.344136 * (cb - 128) - 0.714136 * (cr - 128),
                     y + 1.772 * (cb - 128)], -1).clip(0, 255)
    assert np.abs(decode(data).astype(np.float64) - want).max() <= 1.5


@pytest.mark.parametrize("mode, array, reason", [
    ("I", np.arange(12, dtype=np.int32).reshape(3, 4) * 1000, "32-bit integer pixels"),
    ("F", np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4), "32-bit floating-point"),
])
def test_integer_and_float_pixels_are_refused_by_mode(mode, array, reason):
    data = encode(Image.fromarray(array), "TIFF")
    assert Image.open(io.BytesIO(data)).mode == mode
    with pytest.raises(InvalidImage) as info:
        decode(data)
    assert f"TIFF image in mode {mode}: {reason}" in str(info.value)
    assert "no unambiguous 8-bit mapping" in str(info.value)


def test_cielab_is_refused_by_mode():
    data = encode(Image.new("LAB", (4, 3)), "TIFF")
    with pytest.raises(InvalidImage, match="TIFF image in mode LAB: CIELab colour"):
        decode(data)


# ---- orientation -----------------------------------------------------------------------------
def upright_from_stored(stored: np.ndarray, orientation: int) -> np.ndarray:
    """EXIF 2.3, tag 0x0112: where the stored 0th row and 0th column are in the picture."""
    s = stored
    return {
        1: s,
        2: s[:, ::-1],  # row 0 top, column 0 right
        3: s[::-1, ::-1],  # row 0 bottom, column 0 right
        4: s[::-1],  # row 0 bottom, column 0 left
        5: s.transpose(1, 0, 2),  # row 0 left, column 0 top
        6: s.transpose(1, 0, 2)[:, ::-1],  # row 0 right, column 0 top
        7: s.transpose(1, 0, 2)[::-1, ::-1],  # row 0 right, column 0 bottom
        8: s.transpose(1, 0, 2)[::-1],  # row 0 left, column 0 bottom
    }[orientation]


def exif(orientation: int) -> bytes:
    tags = Image.Exif()
    tags[0x0112] = orientation
    return tags.tobytes()


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied(orientation):
    stored = rgb(6, 9, seed=orientation)
    data = encode(Image.fromarray(stored), "PNG", exif=exif(orientation))
    np.testing.assert_array_equal(decode(data), upright_from_stored(stored, orientation))


def test_phone_jpeg_with_orientation_6_is_upright():
    upright = np.zeros((48, 64, 3), np.uint8)
    upright[:16] = 255  # a white band at the top of the picture
    stored = np.ascontiguousarray(np.rot90(upright))  # what the camera wrote: rotated left
    data = encode(Image.fromarray(stored), "JPEG", quality=95, exif=exif(6))
    got = decode(data)
    assert got.shape == upright.shape
    assert np.abs(got.astype(int) - upright).mean() < 3


def test_tiff_orientation_tag_is_applied():
    stored = rgb(5, 8, seed=9)
    data = encode(Image.fromarray(stored), "TIFF", tiffinfo={274: 8})
    np.testing.assert_array_equal(decode(data), upright_from_stored(stored, 8))


def _pillow_avif(data: bytes, mode: str = "RGB") -> np.ndarray:
    """Pillow's own decode of an AVIF (lossy: the reference is the decoder, not the source)."""
    return np.asarray(Image.open(io.BytesIO(data)).convert(mode))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_avif_is_decoded_and_its_irot_imir_orientation_applied(orientation):
    """Pillow writes an EXIF orientation into an AVIF as its irot/imir boxes and reads them
    back as the EXIF orientation: the pixels are the stored ones, turned as browsers show
    them."""
    stored = rgb(24, 40, seed=orientation)
    plain = encode(Image.fromarray(stored), "AVIF", quality=90)
    turned = encode(Image.fromarray(stored), "AVIF", quality=90, exif=exif(orientation))
    assert b"irot" in turned or b"imir" in turned or orientation == 1
    np.testing.assert_array_equal(decode(plain), _pillow_avif(plain))
    np.testing.assert_array_equal(decode(turned),
                                  upright_from_stored(_pillow_avif(plain), orientation))


def test_avif_transparency_animation_grey_and_size_limit():
    colour, alpha = rgb(16, 24, seed=3), rgb(16, 24, seed=4)[..., :1]
    data = encode(Image.fromarray(np.concatenate([colour, alpha], 2), "RGBA"), "AVIF")
    decoded = _pillow_avif(data, "RGBA")
    np.testing.assert_array_equal(decode(data), over_white(decoded[..., :3], decoded[..., 3]))
    first, second = rgb(16, 24, seed=5), rgb(16, 24, seed=6)
    buffer = io.BytesIO()
    Image.fromarray(first).save(buffer, "AVIF", save_all=True,
                                append_images=[Image.fromarray(second)])
    animated = buffer.getvalue()
    np.testing.assert_array_equal(decode(animated), _pillow_avif(animated))  # frame 0
    grey = encode(Image.fromarray(first[..., 0]), "AVIF")
    np.testing.assert_array_equal(decode(grey), _pillow_avif(grey))
    with pytest.raises(InvalidImage, match="declared size of the AVIF is 24x16 = 384 pixels"):
        decode(data, max_pixels=100)
    # an AVIF whose major brand is HEIF's generic mif1, or miaf, is read as AVIF (a HEIC with
    # mif1 is not: test_well_known_files_pillow_does_not_read_are_refused_by_name)
    for brands in (b"mif1\x00\x00\x00\x00mif1avifmiaf", b"miaf\x00\x00\x00\x00miafavif"):
        with pytest.raises(InvalidImage, match="AVIF file, but its header is unusable"):
            decode(b"\x00\x00\x00\x1cftyp" + brands + bytes(64))  # brands alone: no image


def heic(image: Image.Image, *more: Image.Image, **params) -> bytes:
    """``photos.heic``, the test skipped where pillow-heif is not installed."""
    pytest.importorskip("pillow_heif")
    return photos.heic(image, *more, **params)


LOSSLESS = {"quality": -1, "chroma": 444}  # RGB -> YCbCr 4:4:4 and back: within 2 levels


@pytest.mark.parametrize("orientation", range(1, 9))
def test_heic_is_decoded_and_its_boxes_turn_it_once(orientation):
    """The reference is independent of libheif: FFmpeg's reading of the stored pixels (PyAV:
    no transform applied), turned by the orientation the file's boxes and EXIF both state.
    Turning it twice (libheif's boxes, then the EXIF again) fails here. Sides of whole coding
    blocks (64): FFmpeg reads the coded picture, without the crop a smaller image declares."""
    av = pytest.importorskip("av")
    image = Image.fromarray(rgb(64, 128, seed=orientation))
    image.info["exif"] = exif(orientation)
    data = heic(image, **LOSSLESS)
    assert (b"irot" in data or b"imir" in data) == (orientation != 1)
    with av.open(io.BytesIO(data)) as container:
        stored = next(container.decode(video=0)).to_ndarray(format="rgb24")
    got, want = decode(data), upright_from_stored(stored, orientation)
    assert got.shape == want.shape
    assert np.abs(got.astype(int) - want).max() <= 2  # two YCbCr -> RGB conversions


def test_heic_primary_image_transparency_grey_odd_size_and_limit():
    pillow_heif = pytest.importorskip("pillow_heif")
    source = rgb(37, 51, seed=11)  # odd sides: the coded picture is padded, then cropped
    data = heic(Image.fromarray(source), **LOSSLESS)
    assert np.abs(decode(data).astype(int) - source).max() <= 2
    colour, alpha = rgb(16, 24, seed=3), rgb(16, 24, seed=4)[..., :1]
    data = heic(Image.fromarray(np.concatenate([colour, alpha], 2), "RGBA"), **LOSSLESS)
    decoded = np.asarray(pillow_heif.open_heif(io.BytesIO(data)).to_pillow().convert("RGBA"))
    np.testing.assert_array_equal(decode(data), over_white(decoded[..., :3], decoded[..., 3]))
    grey = rgb(16, 24, seed=5)[..., 0]
    got = decode(heic(Image.fromarray(grey), **LOSSLESS))
    assert np.abs(got.astype(int) - grey[..., None]).max() <= 2
    # several images: the primary one, wherever it is in the file
    first, second = rgb(16, 24, seed=6), rgb(16, 24, seed=7)
    both = heic(Image.fromarray(first), Image.fromarray(second), primary_index=1, **LOSSLESS)
    assert np.abs(decode(both).astype(int) - second).max() <= 2
    with pytest.raises(InvalidImage, match="declared size of the HEIC is 51x37 = 1887 pixels"):
        decode(heic(Image.fromarray(source)), max_pixels=1000)
    with pytest.raises(InvalidImage, match="HEIC file, but its header is unusable"):
        decode(b"\x00\x00\x00\x1cftypmif1\x00\x00\x00\x00mif1heic" + bytes(64))


def test_a_10_bit_heic_arrives_as_its_high_8_bits():
    """Phones' HDR photos are 10-bit HEVC: libheif keeps the high 8 bits of each sample (as
    Pillow does for 16-bit colour PNG), the contract's documented rule. The samples themselves
    are read from the same file at 16 bits (pillow-heif scales 10-bit values by 64)."""
    pillow_heif = pytest.importorskip("pillow_heif")
    ramp = np.linspace(0, 65535, 1024).astype(np.uint16)  # every 10-bit level once
    wide = np.stack([np.tile(ramp, (8, 1))] * 3, -1)
    buffer = io.BytesIO()
    pillow_heif.from_bytes("RGB;16", (1024, 8), wide.tobytes()).save(buffer, **LOSSLESS)
    file = pillow_heif.open_heif(io.BytesIO(buffer.getvalue()), convert_hdr_to_8bit=False)
    assert file.info["bit_depth"] == 10
    samples = np.asarray(file[0]).astype(np.int64) >> 6  # the stored 10-bit values
    assert len(np.unique(samples)) > 1000
    np.testing.assert_array_equal(decode(buffer.getvalue()), samples >> 2)


def test_a_heic_whose_coded_picture_is_larger_than_declared_is_refused_before_decoding():
    """The size checked before decoding is the container's (ispe); the HEVC stream declares its
    own. A file declaring 64x64 around a 2048x2048 picture is refused by libheif's limits before
    the picture is decoded, not decoded past the pixel limit."""
    data = heic(Image.new("RGB", (2048, 2048)), quality=10)
    at = data.find(b"ispe")
    assert struct.unpack(">II", data[at + 8 : at + 16]) == (2048, 2048)
    small = data[: at + 8] + struct.pack(">II", 64, 64) + data[at + 16 :]
    with pytest.raises(InvalidImage, match="cannot decode HEIC image: .*exceeds the maximum"):
        decode(small, max_pixels=64 * 64)


def test_mutated_heics_are_decoded_or_refused_and_nothing_else():
    """libheif and libde265 are C: a hostile sender's mutated files must come back as an image
    or an InvalidImage naming HEIC, never another exception (or a crash of this process)."""
    seeds = [heic(Image.fromarray(rgb(40, 56, seed=k)), quality=60) for k in range(3)]
    rnd = np.random.default_rng(3)
    outcomes = {"decoded": 0, "refused": 0}
    for k in range(300):
        data = bytearray(seeds[k % 3])
        if k % 3 == 0:
            data = data[: rnd.integers(1, len(data))]
        else:
            for at in rnd.integers(0, len(data), rnd.integers(1, 9)):
                data[at] = rnd.integers(0, 256)
        try:
            assert decode(bytes(data)).dtype == np.uint8
            outcomes["decoded"] += 1
        except InvalidImage as err:
            assert "HEIC" in str(err) or "not an image file" in str(err) or "ISO" in str(err)
            assert str(err) == str(err).strip()  # libheif's messages end in a newline
            outcomes["refused"] += 1
    assert outcomes["decoded"] and outcomes["refused"]  # both outcomes were exercised


def test_a_heic_whose_exif_item_has_another_type_does_not_crash_the_process(tmp_path):
    """pi-heif 1.4 (libheif 1.23.0) crashed the process (SIGSEGV) on a HEIC whose Exif item's
    type had one byte changed, found by a fuzz of mutated files (benchmarks/NOTES.md, "HEIC
    accepted"); the contract's pillow-heif must decode or refuse it. In a child process, where
    a crash is an exit status rather than the end of the test run."""
    image = Image.fromarray(rgb(60, 80, seed=12))
    image.info["exif"] = exif(6)
    data = heic(image, quality=40)
    at = data.index(b"Exif")  # the item's type in its infe box, before any Exif payload
    for k, kind in enumerate((b"Ex\xf4f", b"mime", b"uri ", bytes(4))):
        (tmp_path / f"{k}.heic").write_bytes(data[:at] + kind + data[at + 4 :])
    code = ("import sys; from pathlib import Path; from vit22b.model.pixels import decode\n"
            "from vit22b.model.errors import InvalidImage\n"
            "for path in sorted(Path(sys.argv[1]).glob('*.heic')):\n"
            "    print(path.name, flush=True)\n"
            "    try: print(decode(path.read_bytes()).shape)\n"
            "    except InvalidImage as err: print('refused:', err)\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    outcomes = re.findall(r"^(?:\((?:60, 80|80, 60), 3\)|refused: HEIC.*)$", done.stdout, re.M)
    assert len(outcomes) == 4, done.stdout


def test_heic_without_its_decoder_is_refused_saying_what_to_install(monkeypatch):
    data = heic(Image.fromarray(rgb(8, 8)))
    monkeypatch.setattr(contract, "_heif_reader", lambda: False)
    with pytest.raises(InvalidImage, match=r"HEIC image, but its decoder is not installed "
                                           r"\(pillow-heif, in the vit22b\[model\] extra\)"):
        decode(data)


def test_the_contract_names_the_rules_and_its_hash_covers_them():
    cfg = get_config("vit-22b-tiny/16")
    text = Preprocessor(cfg).describe()
    for rule in ("EXIF orientation applied", "BMP", "GIF", "TIFF", "16-bit grey",
                 "transparency over RGB (255, 255, 255)", "modes I, F and LAB refused"):
        assert rule in text
    # the decode rules are part of the hash: it is not the hash of the resize/crop fields alone
    import hashlib
    import json

    fields_only = {"image_size": cfg.image_size, **cfg.preprocess.to_dict()}
    old = hashlib.sha256(json.dumps(fields_only, sort_keys=True).encode()).hexdigest()[:16]
    assert cfg.preprocess_hash() != old
    assert ViTConfig.from_dict(cfg.to_dict()).preprocess_hash() == cfg.preprocess_hash()


def test_the_crop_offset_is_rounded_or_floored_as_the_contract_says():
    """A margin of 3 mod 4 puts torchvision's rounded centre (as timm and open_clip crop) and
    transformers' floored one a pixel apart: the contract says which (Preprocess.crop_offset),
    the default keeps every earlier contract's hash, the other is a hash of its own."""
    from vit22b.model.config import ConfigError, Preprocess

    cfg = get_config("vit-22b-tiny/16")  # 64x64 input
    rounded = cfg.replace(preprocess=Preprocess(resize=64))
    floored = cfg.replace(preprocess=Preprocess(resize=64, crop_offset="floor"))
    pixels = rgb(64, 75, seed=3)  # a 64 x 75 image: margin 11 = 3 mod 4, offsets 6 and 5
    assert np.array_equal(Preprocessor(rounded).crop(pixels), pixels[:, 6:70])
    assert np.array_equal(Preprocessor(floored).crop(pixels), pixels[:, 5:69])
    assert "crop_offset" not in rounded.preprocess.to_dict()
    assert rounded.preprocess_hash() == cfg.replace(preprocess=Preprocess(64)).preprocess_hash()
    assert floored.preprocess_hash() != rounded.preprocess_hash()
    assert "floored" in Preprocessor(floored).describe()
    assert ViTConfig.from_dict(floored.to_dict()).preprocess == floored.preprocess
    with pytest.raises(ConfigError, match="crop_offset='ceil' is not one of"):
        Preprocess(crop_offset="ceil")


def test_a_contract_can_squash_both_sides_before_its_centre_crop():
    """DeiT's processor and timm's crop_mode 'squash' (crop_pct < 1): both sides resized to
    ``resize``, aspect ratio not kept, then the centre crop (Preprocess.keep_aspect False); PIL's
    own resize of the pair and a slice are the reference, at the model's size, at another
    resolution (the resize scaled with it) and past the crops' worth of pixels where only the
    crop's source box is resampled. The default keeps every earlier hash."""
    from vit22b.model.config import ConfigError, Preprocess
    from vit22b.model.pixels import FULL_RESIZE_CROPS, Geometry

    cfg = get_config("vit-22b-tiny/16")  # 64x64 input
    squash = cfg.replace(preprocess=Preprocess(resize=75, keep_aspect=False, crop_offset="floor"))
    for height, width in ((64, 75), (120, 90), (48, 300)):
        pixels = rgb(height, width, seed=height)
        theirs = np.asarray(Image.fromarray(pixels).resize((75, 75), Image.Resampling.BICUBIC))
        assert np.array_equal(Preprocessor(squash).crop(pixels), theirs[5:69, 5:69])
    at_32 = Preprocessor(squash, Geometry(resolution=32))  # resize 75 * 32 / 64 -> 38
    pixels = rgb(50, 70, seed=5)
    theirs = np.asarray(Image.fromarray(pixels).resize((38, 38), Image.Resampling.BICUBIC))
    assert np.array_equal(at_32.crop(pixels), theirs[3:35, 3:35])
    wide = cfg.replace(preprocess=Preprocess(resize=64 * 9, keep_aspect=False))
    assert 576 * 576 > FULL_RESIZE_CROPS * 64 * 64  # the source-box path
    pixels = rgb(300, 500, seed=6)
    full = np.asarray(Image.fromarray(pixels).resize((576, 576), Image.Resampling.BICUBIC))
    box = Preprocessor(wide).crop(pixels).astype(int)
    assert box.shape == (64, 64, 3) and np.abs(box - full[256:320, 256:320]).max() <= 2
    assert "keep_aspect" not in Preprocess(resize=75).to_dict()
    assert squash.preprocess_hash() != cfg.replace(
        preprocess=Preprocess(resize=75, crop_offset="floor")).preprocess_hash()
    assert ViTConfig.from_dict(squash.to_dict()).preprocess == squash.preprocess
    assert "resize both sides to 75x75" in Preprocessor(squash).describe()
    with pytest.raises(ConfigError, match="keep_aspect=false needs crop=true"):
        Preprocess(crop=False, keep_aspect=False)


# ---- limits ----------------------------------------------------------------------------------
def test_the_pixel_limit_names_the_server_setting():
    data = encode(Image.fromarray(rgb(50, 50)), "PNG")
    with pytest.raises(InvalidImage) as info:
        decode(data, max_pixels=2000)
    assert "declared size of the PNG is 50x50 = 2500 pixels, over the limit of 2000 " in str(
        info.value)
    assert "--max-image-pixels" in str(info.value)


@pytest.mark.parametrize("fmt", ["PNG", "GIF", "TIFF"])
def test_pillows_own_bomb_guard_never_decides(fmt, monkeypatch):
    """Pillow's process-wide guard set far below the server's limit: the limit still decides."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # refuses above 2000
    pixels = rgb(50, 50)  # 2500 pixels
    data = encode(Image.fromarray(pixels if fmt != "GIF" else pixels // 64 * 64), fmt)
    assert decode(data, max_pixels=10_000).shape == (50, 50, 3)
    with pytest.raises(InvalidImage, match="over the limit of 2400 .*--max-image-pixels"):
        decode(data, max_pixels=2400)


def test_decoding_in_threads_gives_the_sequential_results():
    blobs = [encode(Image.fromarray(rgb(20 + i, 30, seed=i)), fmt, exif=exif(1 + i % 8))
             for i, fmt in enumerate(["PNG", "WEBP", "TIFF", "JPEG"] * 6)]
    want = [decode(b) for b in blobs]
    with ThreadPoolExecutor(8) as pool:
        for _ in range(3):
            for got, expected in zip(pool.map(decode, blobs), want):
                np.testing.assert_array_equal(got, expected)


# ---- the resampled window --------------------------------------------------------------------
def full_resize_then_crop(pixels: np.ndarray, cfg: ViTConfig) -> np.ndarray:
    """The contract as torchvision's PIL Resize(shorter side) + CenterCrop computes it."""
    p, size = cfg.preprocess, cfg.image_size
    height, width = pixels.shape[:2]
    short = min(height, width)
    new_h = p.resize if height == short else int(p.resize * height / short)
    new_w = p.resize if width == short else int(p.resize * width / short)
    resized = np.asarray(Image.fromarray(pixels).resize((new_w, new_h), Image.Resampling.BICUBIC))
    top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
    return resized[top : top + size, left : left + size]


@pytest.mark.parametrize("name", ["vit-22b-tiny/16", "vit-b/16"])
def test_normal_aspect_ratios_are_exactly_the_full_resize(name):
    cfg, rng = get_config(name), np.random.default_rng(11)
    pre = Preprocessor(cfg)
    limit = FULL_RESIZE_CROPS * cfg.image_size**2 / cfg.preprocess.resize**2
    for ratio in (1.0, 1.33, 3.0, 16.0, limit * 0.95):
        short = int(rng.integers(3, 300))
        for shape in ((short, int(short * ratio)), (int(short * ratio), short)):
            pixels = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
            np.testing.assert_array_equal(pre.crop(pixels), full_resize_then_crop(pixels, cfg))


def test_extreme_aspect_ratios_resample_the_crop_window_only():
    """Past 64 crops' worth, the window alone: measured against the full resize (affordable
    here, 1 x 100..300 strips and 2..40 pixel-wide bands of a smooth image)."""
    cfg = get_config("vit-22b-tiny/16")
    pre, rng, worst, means = Preprocessor(cfg), np.random.default_rng(5), 0, []
    for _ in range(20):
        short, ratio = int(rng.integers(1, 40)), rng.uniform(70, 300)
        shape = (int(short * ratio), short) if rng.random() < 0.5 else (short, int(short * ratio))
        coarse = rng.integers(0, 256, (max(shape[0] // 16, 2), max(shape[1] // 16, 2), 3),
                              dtype=np.uint8)
        pixels = np.asarray(Image.fromarray(coarse).resize(shape[::-1], Image.Resampling.BILINEAR))
        diff = np.abs(pre.crop(pixels).astype(int) - full_resize_then_crop(pixels, cfg))
        worst, means = max(worst, diff.max()), [*means, diff.mean()]
    assert worst <= 2 and np.mean(means) < 0.1, (worst, np.mean(means))


def test_a_1x100000_strip_costs_a_crop_not_a_64x6400000_image():
    pre = Preprocessor(get_config("vit-22b-tiny/16"))
    strip = np.zeros((100_000, 1, 3), np.uint8)
    strip[49_000:51_000] = 200  # the centre crop's window lies inside this band
    start = time.perf_counter()
    out = pre.crop(strip)
    assert time.perf_counter() - start < 1.0
    np.testing.assert_array_equal(out, np.full((64, 64, 3), 200, np.uint8))


def test_to_rgb_applies_the_same_rules_to_a_pil_image():
    from vit22b.model.pixels import to_rgb

    colour, alpha = rgb(5, 6, seed=4), RNG.integers(0, 256, (5, 6), dtype=np.uint8)
    np.testing.assert_array_equal(to_rgb(Image.fromarray(np.dstack([colour, alpha]))),
                                  over_white(colour, alpha))
    with pytest.raises(InvalidImage, match="image in mode F: 32-bit floating-point"):
        to_rgb(Image.fromarray(np.zeros((2, 2), np.float32)))


# ---- reduced-size JPEG decoding (DCT scaling) ------------------------------------------------
# The stated tolerance (model/pixels.py): on photo-like JPEGs the resized crop differs from full
# decoding's by at most 1 level of 255 on average and 10 levels at the 99.9th percentile (the
# few pixels beyond sit on hard coloured edges).
DRAFT_MEAN_LEVELS, DRAFT_P999_LEVELS = 1.0, 10.0


@pytest.mark.parametrize("name", ["vit-22b-tiny/16", "vit-b/16"])
@pytest.mark.parametrize("width, height", [(4000, 3000), (2000, 1500), (816, 612), (1024, 768)])
def test_reduced_size_decoding_stays_within_the_stated_tolerance(name, width, height):
    pre = Preprocessor(get_config(name))
    data = photo_jpeg(width, height, seed=width)
    full, reduced = decode(data), decode(data, min_side=pre.min_side)
    scale = draft_scale(width, height, pre.min_side)
    assert reduced.shape == (height // scale, width // scale, 3)
    assert min(reduced.shape[:2]) >= DRAFT_MARGIN * pre.min_side  # never upsampled after
    diff = np.abs(pre.crop(full).astype(np.float64) - pre.crop(reduced))
    assert diff.mean() <= DRAFT_MEAN_LEVELS, diff.mean()
    assert np.percentile(diff, 99.9) <= DRAFT_P999_LEVELS, np.percentile(diff, 99.9)
    np.testing.assert_array_equal(pre.load(data), pre(reduced))  # the contract's own path


def test_the_draft_scale_divides_both_sides_and_keeps_the_margin():
    assert draft_scale(4000, 3000, 64) == 8  # 500x375 >= 2 x 64
    assert draft_scale(4000, 3000, 224) == 4  # 1000x750; 1/8 would give 375 < 448
    assert draft_scale(2000, 1500, 248) == 2  # 1/4 would give 375 < 496
    assert draft_scale(2000, 1502, 64) == 2  # 1502 is not a multiple of 4 or 8
    assert draft_scale(2001, 1500, 64) == 1  # an odd side: no exact reduction
    assert draft_scale(256, 256, 64) == 2 and draft_scale(255, 256, 64) == 1
    assert draft_scale(200, 200, 64) == 1  # 1/2 would give 100 < 128


def test_only_jpeg_is_decoded_at_reduced_size():
    pixels = np.asarray(photo(512, 384))
    for fmt in ("PNG", "WEBP"):
        data = encode(Image.fromarray(pixels), fmt, **({"lossless": True} if fmt == "WEBP" else {}))
        np.testing.assert_array_equal(decode(data, min_side=64), pixels)
    jpeg = encode(Image.fromarray(pixels), "JPEG", quality=90)
    assert decode(jpeg, min_side=64).shape == (192, 256, 3)  # 1/2: 192 >= 2 x 64; 1/4 < 128
    assert decode(jpeg).shape == (384, 512, 3)  # no min_side: full size


def test_reduced_size_decoding_is_part_of_the_contract_and_its_hash():
    pre = Preprocessor(get_config("vit-b/16"))
    assert PIXEL_RULES >= 3  # the version that introduced it: the hash changed with it
    assert f"keeps both >= {DRAFT_MARGIN} x {pre.min_side}" in pre.describe()


@pytest.mark.parametrize("name", ["vit-22b-tiny/16", "vit-b/16", "siglip-b/16", "clip-b/16"])
def test_normalising_by_table_is_the_formula_bit_for_bit(name):
    """The look-up table holds the contract's float32 formula at every level; any image (here
    every level in every channel, and odd layouts: a non-contiguous crop) gets the same bits."""
    pre = Preprocessor(get_config(name))
    every = np.stack(np.meshgrid(np.arange(256), np.arange(256), indexing="ij"), -1)
    grid = np.concatenate([every, every[..., :1]], -1).astype(np.uint8)  # [256, 256, 3]
    for pixels in (grid, grid[3:200:3, ::-2], RNG.integers(0, 256, (5, 7, 3), dtype=np.uint8)):
        got = pre.normalise(pixels)
        want = normalise_formula(pixels, pre.cfg.preprocess)
        assert got.dtype == np.float32 and got.shape == pixels.shape
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_an_image_error_quotes_a_long_id_cut_to_its_start():
    assert str(InvalidImage("bad", 2, "bad")) == "image 2 (id 'bad'): bad"
    assert str(InvalidImage("bad", 2, "2")) == "image 2: bad"  # ids default to the position
    long = "x" * 5000
    message = str(InvalidImage("cannot decode", 0, long))
    assert message == f"image 0 (id '{'x' * 80}'... (5000 characters)): cannot decode"
    assert InvalidImage("r", 0, long).image_id == long  # the error still carries it whole


# ---- the fast decoder for plain JPEGs ----------------------------------------------------------
def pillow_only(data: bytes, monkeypatch, **kwargs):
    """``decode`` with Pillow decoding everything (the reference), or the error it raises."""
    with monkeypatch.context() as patch:
        patch.setattr(contract, "simplejpeg", None)
        try:
            return decode(data, **kwargs)
        except InvalidImage as err:
            return err


def assert_pillows_answer(data: bytes, monkeypatch, note: str = ""):
    """``decode``'s answer is Pillow's: the same pixels, or the same refusal word for word;
    returns Pillow's."""
    try:
        got = decode(data)
    except InvalidImage as err:
        got = err
    reference = pillow_only(data, monkeypatch)
    if isinstance(reference, InvalidImage):
        assert isinstance(got, InvalidImage) and str(got) == str(reference), note
    else:
        np.testing.assert_array_equal(got, reference, err_msg=note)
    return reference


def takes_fast_path(data: bytes) -> bool:
    opened = contract.open_encoded(data)
    return contract._decode_jfif(opened, contract._name(opened.format)) is not None


PLAIN_JPEGS = {
    "rgb 4:2:0": (photo(64, 64), {"subsampling": "4:2:0"}),
    "rgb 4:2:2": (photo(333, 201, seed=1), {"subsampling": "4:2:2", "quality": 50}),
    "rgb 4:4:4": (photo(37, 19, seed=2), {"subsampling": "4:4:4", "quality": 98}),
    "noise 4:2:0 odd sides": (Image.fromarray(rgb(13, 7, seed=3)), {"quality": 90}),
    "one pixel": (Image.fromarray(rgb(1, 1, seed=4)), {}),
    "progressive": (photo(120, 80, seed=5), {"progressive": True, "quality": 75}),
    "optimised, quality 5": (photo(96, 64, seed=6), {"optimize": True, "quality": 5}),
    "restart markers": (photo(64, 48, seed=7), {"restart_marker_blocks": 4}),
    "grey": (photo(50, 70, seed=8).convert("L"), {}),
    "grey progressive": (photo(64, 64, seed=9).convert("L"), {"progressive": True}),
}


@pytest.mark.skipif(contract.simplejpeg is None, reason="simplejpeg is not installed")
@pytest.mark.parametrize("name", sorted(PLAIN_JPEGS))
def test_plain_jpegs_decode_to_pillows_pixels_bit_for_bit(name, monkeypatch):
    image, params = PLAIN_JPEGS[name]
    data = encode(image, "JPEG", **params)
    assert takes_fast_path(data)
    got, reference = decode(data), pillow_only(data, monkeypatch)
    assert got.dtype == np.uint8 and got.shape == (image.height, image.width, 3)
    np.testing.assert_array_equal(got, reference)


def cmyk_jpeg() -> bytes:
    return encode(photo(40, 30).convert("CMYK"), "JPEG")


def truncated_jpeg() -> bytes:
    data = encode(photo(64, 64), "JPEG")
    return data[: len(data) // 2]


def extraneous_bytes_jpeg() -> bytes:  # libjpeg warns ("Corrupt JPEG data"), Pillow decodes
    data = encode(photo(64, 64), "JPEG")
    return data[:-2] + b"\x00\x17\x00" + data[-2:]


LEFT_TO_PILLOW = {
    "EXIF orientation 6": lambda: encode(photo(48, 32), "JPEG", exif=exif(6)),
    "CMYK (Adobe marker)": cmyk_jpeg,
    "truncated": truncated_jpeg,
    "extraneous bytes before a marker": extraneous_bytes_jpeg,
}


@pytest.mark.skipif(contract.simplejpeg is None, reason="simplejpeg is not installed")
@pytest.mark.parametrize("name", sorted(LEFT_TO_PILLOW))
def test_other_jpegs_are_pillows_answer(name, monkeypatch):
    data = LEFT_TO_PILLOW[name]()
    try:
        assert not takes_fast_path(data)
        got = decode(data)
    except InvalidImage as err:
        got = err
    reference = pillow_only(data, monkeypatch)
    if isinstance(reference, InvalidImage):
        assert isinstance(got, InvalidImage) and str(got) == str(reference)
        assert name == "truncated"
    else:
        np.testing.assert_array_equal(got, reference)


def icc_jpeg() -> bytes:
    from PIL import ImageCms

    profile = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    return encode(photo(40, 30), "JPEG", icc_profile=profile)


def mpo() -> bytes:
    out = io.BytesIO()
    photo(40, 30).save(out, "MPO", save_all=True, append_images=[photo(40, 30, seed=1)])
    return out.getvalue()


@pytest.mark.skipif(contract.simplejpeg is None, reason="simplejpeg is not installed")
def test_plain_jpegs_are_told_from_their_bytes(monkeypatch):
    """``plain_jpeg`` reads a plain JPEG's size from its markers (no Pillow); any application
    segment that could change the picture (orientation, colour transform, another picture) and
    any frame Pillow's route must see leaves it to Pillow, which still gives the same pixels."""
    for name, (image, params) in PLAIN_JPEGS.items():
        bands = 1 if image.mode == "L" else 3
        assert plain_jpeg(encode(image, "JPEG", **params)) == (image.height, image.width, bands), (
            name)
    others = {"EXIF orientation 1": encode(photo(48, 32), "JPEG", exif=exif(1)),
              "ICC profile": icc_jpeg(), "MPO": mpo(), "CMYK (Adobe marker)": cmyk_jpeg(),
              "12-bit frame": b"\xff\xd8\xff\xc0\x00\x0b\x0c\x00\x08\x00\x08\x01\x01\x11\x00",
              "PNG": encode(photo(8, 8), "PNG")}
    for name, data in others.items():
        assert plain_jpeg(data) is None, name
        assert_pillows_answer(data, monkeypatch, name)


@pytest.mark.skipif(contract.simplejpeg is None, reason="simplejpeg is not installed")
def test_a_plain_jpeg_over_the_pixel_limit_is_refused_as_pillows_route_refuses_it(monkeypatch):
    data = encode(photo(64, 48), "JPEG")
    assert plain_jpeg(data) == (48, 64, 3)
    with pytest.raises(InvalidImage) as refused:
        decode(data, max_pixels=1000)
    assert str(refused.value) == str(pillow_only(data, monkeypatch, max_pixels=1000))
    assert "declared size of the JPEG is 64x48 = 3072 pixels" in str(refused.value)


def test_reduced_size_jpegs_are_pillows(monkeypatch):
    data = photo_jpeg(640, 480)
    got = decode(data, min_side=100)
    assert got.shape == (240, 320, 3)  # decoded at 1/2 by Pillow's draft
    np.testing.assert_array_equal(got, pillow_only(data, monkeypatch, min_side=100))


@pytest.mark.skipif(contract.simplejpeg is None, reason="simplejpeg is not installed")
def test_mutated_jpegs_get_pillows_answer(monkeypatch):
    """Random byte changes and cuts: the fast decoder never changes an answer (the same pixels,
    or the same refusal, word for word)."""
    rng = np.random.default_rng(1)
    bases = [encode(photo(64, 64), "JPEG"), encode(photo(48, 40, seed=3), "JPEG", progressive=True),
             encode(photo(32, 32, seed=4).convert("L"), "JPEG")]
    outcomes = {"pixels": 0, "refused": 0}
    for base in bases:
        for _ in range(100):
            data = bytearray(base)
            for _ in range(rng.integers(1, 6)):
                data[rng.integers(2, len(data))] = rng.integers(0, 256)
            if rng.random() < 0.2:
                data = data[: rng.integers(10, len(data))]
            reference = assert_pillows_answer(bytes(data), monkeypatch)
            outcomes["refused" if isinstance(reference, InvalidImage) else "pixels"] += 1
    assert min(outcomes.values()) > 50  # both kinds of answer were exercised


@pytest.mark.skipif(contract.simplejpeg is None, reason="simplejpeg is not installed")
def test_mutated_jpeg_headers_get_pillows_answer(monkeypatch):
    """Byte changes confined to the markers before the first scan, where ``plain_jpeg`` reads:
    whatever it lets through to simplejpeg gets Pillow's pixels or Pillow's refusal."""
    rng = np.random.default_rng(2)
    bases = [encode(photo(64, 64), "JPEG"), encode(photo(48, 40, seed=3), "JPEG", progressive=True),
             encode(photo(32, 32, seed=4).convert("L"), "JPEG", restart_marker_blocks=2)]
    through = {"pixels": 0, "refused": 0}
    for base in bases:
        header = base.index(b"\xff\xda") + 14  # the markers, and the scan header's first bytes
        for _ in range(150):
            data = bytearray(base)
            for _ in range(rng.integers(1, 3)):
                data[rng.integers(2, header)] = rng.integers(0, 256)
            data = bytes(data)
            reference = assert_pillows_answer(data, monkeypatch)
            if plain_jpeg(data) is not None:
                through["refused" if isinstance(reference, InvalidImage) else "pixels"] += 1
    assert min(through.values()) > 10  # the fast path saw both kinds of answer


def tiled_tiff(side: int, tile: int, values: np.ndarray) -> bytes:
    """A grey, deflated TIFF of ``side`` x ``side`` pixels held in one ``tile`` x ``tile`` tile
    (``values``: the tile's pixels), written by hand: Pillow writes strips only."""
    payload = zlib.compress(values.astype(np.uint8).tobytes())
    tags = [(256, 4, side), (257, 4, side), (258, 3, 8), (259, 3, 8), (262, 3, 1), (277, 3, 1),
            (284, 3, 1), (322, 4, tile), (323, 4, tile), (324, 4, 0), (325, 4, len(payload))]
    tags[-2] = (324, 4, 8 + 2 + len(tags) * 12 + 4)  # the tile's offset: after the IFD
    ifd = struct.pack("<H", len(tags)) + b"".join(
        struct.pack("<HHIHH" if kind == 3 else "<HHII", tag, kind, 1, value, *(
            (0,) if kind == 3 else ())) for tag, kind, value in tags)
    return b"II*\0" + struct.pack("<I", 8) + ifd + b"\0\0\0\0" + payload


def test_a_tiffs_declared_tile_counts_against_the_pixel_limit():
    """libtiff allocates a whole declared tile whatever the image's size (an 8x8 TIFF declaring
    a 16384^2 tile took 770 MiB before it failed): the tile is checked like the image."""
    tile = RNG.integers(0, 256, (16, 16), dtype=np.uint8)
    data = tiled_tiff(8, 16, tile)
    np.testing.assert_array_equal(decode(data), np.repeat(tile[:8, :8, None], 3, 2))
    with pytest.raises(InvalidImage, match="declared tile of the TIFF is 16x16 = 256 pixels"):
        decode(data, max_pixels=200)  # the image's 64 pixels fit, its tile does not
    with pytest.raises(InvalidImage, match="tile of the TIFF is 16384x16384"):
        decode(tiled_tiff(8, 16384, tile))  # the bytes hold 16x16; refused before reading them
