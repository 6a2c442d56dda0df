"""The pixel contract through a real server on loopback: a user's folder of files of every
common format and mode, EXIF orientation, the server's pixel limit, and resident memory that
stays flat however long a 1xN strip is.

Every encoded file is compared with the raw pixels it must decode to (computed here in numpy and
sent as raw uint8, which the server takes as given): the same model input, the same features.
"""

from __future__ import annotations

import io
import time

import numpy as np
import pytest
from PIL import Image
from serving import start_server
from test_pixels import LOSSLESS, encode, exif, heic
from vit22b.clients import FeatureClient, FeatureError

LIMIT = 1_500_000  # the server's --max-image-pixels here: room for the 1e6-pixel strips


@pytest.fixture(scope="module")
def server():
    srv = start_server(max_delay_ms=2, max_image_pixels=LIMIT)
    yield srv
    assert srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with FeatureClient(server.address) as c:
        yield c


def folder(root) -> dict[str, np.ndarray]:
    """A user's folder: file name -> the uint8 RGB pixels the file must decode to."""
    rng = np.random.default_rng(21)
    photo = rng.integers(0, 256, (70, 90, 3), dtype=np.uint8)
    indices = rng.integers(0, 32, (66, 80), dtype=np.uint8)
    palette = rng.integers(0, 256, (256, 3), dtype=np.uint8)
    gif = Image.fromarray(indices, mode="P")
    gif.putpalette(palette.tobytes())
    depth = rng.integers(0, 65536, (64, 72)).astype(np.uint16)
    logo, alpha = photo[:64, :64], rng.integers(0, 256, (64, 64), dtype=np.uint8)
    over_white = np.round(logo * (alpha[..., None] / 255) + 255 * (1 - alpha[..., None] / 255))
    files = {
        "scan.bmp": (encode(Image.fromarray(photo), "BMP"), photo),
        "anim.gif": (encode(gif, "GIF", save_all=True, append_images=[gif.rotate(90)]),
                     palette[indices]),
        "page.tiff": (encode(Image.fromarray(photo), "TIFF", compression="tiff_lzw"), photo),
        "depth16.png": (encode(Image.fromarray(depth), "PNG"),
                        np.repeat(np.round(depth / 257.0).astype(np.uint8)[..., None], 3, 2)),
        "logo.png": (encode(Image.fromarray(np.dstack([logo, alpha])), "PNG"),
                     over_white.astype(np.uint8)),
        "phone.png": (encode(Image.fromarray(photo), "PNG", exif=exif(6)),
                      np.ascontiguousarray(photo.transpose(1, 0, 2)[:, ::-1])),  # 90 deg CW
    }
    for name, (data, _) in files.items():
        (root / name).write_bytes(data)
    return {name: pixels for name, (_, pixels) in files.items()}


def test_a_folder_of_bmp_gif_tiff_16_bit_alpha_and_rotated_files(client, tmp_path):
    want = folder(tmp_path)
    paths = [tmp_path / name for name in want]
    got = client.embed(paths)
    assert got.ids == [str(p) for p in paths]
    np.testing.assert_array_equal(got.pooled, client.embed(list(want.values())).pooled)


def test_a_phone_jpeg_is_embedded_upright(client):
    rng = np.random.default_rng(22)
    stored = rng.integers(0, 256, (60, 80, 3), dtype=np.uint8)
    data = encode(Image.fromarray(stored), "JPEG", quality=90, exif=exif(6))
    pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))  # as stored: sideways
    upright = np.ascontiguousarray(np.rot90(pixels, k=-1))  # orientation 6: turn 90 deg CW
    np.testing.assert_array_equal(client.embed([data]).pooled, client.embed([upright]).pooled)
    assert "EXIF orientation applied" in client.model_info().preprocessing.description


def test_a_phone_heic_is_embedded_upright_once(client, tmp_path):
    """A phone's HEIC (irot/imir boxes and an EXIF orientation, both 6) by its file: the
    features of libheif's upright pixels, not of those pixels turned again by the EXIF."""
    pillow_heif = pytest.importorskip("pillow_heif")
    image = Image.fromarray(np.random.default_rng(24).integers(0, 256, (64, 128, 3), np.uint8))
    image.info["exif"] = exif(6)
    path = tmp_path / "IMG_0001.HEIC"
    path.write_bytes(heic(image, **LOSSLESS))
    shown = np.asarray(pillow_heif.open_heif(str(path)).to_pillow().convert("RGB"))
    got = client.embed([path])
    np.testing.assert_array_equal(got.pooled, client.embed([shown]).pooled)
    turned_again = np.ascontiguousarray(np.rot90(shown, k=-1))
    assert not np.allclose(got.pooled, client.embed([turned_again]).pooled, atol=1e-3)


def test_unusable_files_get_their_real_reason(client):
    rng = np.random.default_rng(23)
    zero = bytearray(encode(Image.fromarray(np.zeros((4, 4, 3), np.uint8)), "BMP"))
    zero[18:26] = bytes(8)  # a BMP of 0x0
    floats = encode(Image.fromarray(rng.random((8, 8), dtype=np.float32)), "TIFF")
    icon = encode(Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)), "ICO")
    good = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    got = client.embed([good, bytes(zero), floats, icon, b"plain text"], skip_invalid=True)
    assert list(got.indices) == [0]
    reasons = [e.reason for e in got.errors]
    assert reasons[0].startswith("BMP file, but its header declares no pixels")
    assert "TIFF image in mode F: 32-bit floating-point pixels" in reasons[1]
    assert "ICO (Windows Icon) file (by its signature), not an accepted format" in reasons[2]
    assert reasons[3].startswith("not an image file of a known format")


def test_the_pixel_limit_names_the_servers_setting(client):
    big = encode(Image.fromarray(np.zeros((1200, 1300, 3), np.uint8)), "PNG")  # 1.56M pixels
    with pytest.raises(FeatureError) as info:
        client.embed([big])
    message = str(info.value)
    assert f"1300x1200 = 1560000 pixels, over the limit of {LIMIT}" in message
    assert "--max-image-pixels" in message


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_growth_mb(call) -> float:
    """Peak resident memory of this process (the in-process server's) during ``call``."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current resident size
    base = _kib("VmHWM")
    call()
    return (_kib("VmHWM") - base) / 1024


def test_resident_memory_stays_flat_for_1xn_strips(client, capsys):
    try:
        peak_growth_mb(lambda: None)
    except OSError:
        pytest.skip("this kernel does not let a process reset its peak resident size")
    figures = []
    for n in (1_000, 10_000, 100_000, 1_000_000):
        for shape in ((n, 1), (1, n)):  # 1 wide and n tall, then n wide and 1 tall
            ramp = (np.arange(n, dtype=np.uint32) % 251).astype(np.uint8)
            strip = np.repeat(ramp.reshape(shape)[..., None], 3, 2)
            data = encode(Image.fromarray(strip), "PNG")
            start = time.perf_counter()
            growth = peak_growth_mb(lambda data=data: client.embed([data]))
            seconds = time.perf_counter() - start
            size = f"{shape[1]}x{shape[0]} ({len(data)} B)"
            figures.append(f"{size}: +{growth:.1f} MB {seconds:.2f} s")
            # the decoded strip itself is 3n bytes (3 MB at 1e6); its full shorter-side resize
            # would be 64 x 64n pixels (+3.8 GB at 1e5)
            assert growth < 64, figures
    with capsys.disabled():
        print("\npeak resident growth per strip: " + "; ".join(figures))
