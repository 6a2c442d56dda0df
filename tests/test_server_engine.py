"""The narrow core without gRPC: buckets, output resolution, compile cache, preprocessing."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from serving import png, random_images, shared_engine
from vit22b.model import OutputRequest, get_config
from vit22b.model.errors import InvalidImage, InvalidRequest
from vit22b.model.pixels import Preprocessor, decode
from vit22b.server.batcher import Batcher
from vit22b.server.engine import HOST_ALIGN, LEVELS, NORMALISED, aligned_empty
from vit22b.server.metrics import Metrics
from vit22b.server.plan import batch_buckets


def test_buckets_are_multiples_of_the_data_axis():
    assert batch_buckets(32, 1) == (1, 2, 4, 8, 16, 32)
    assert batch_buckets(32, 2) == (2, 4, 8, 16, 32)
    assert batch_buckets(12, 2) == (2, 4, 8, 12)
    assert batch_buckets(5, 4) == (4, 8)  # the maximum rounds up to the data axis
    assert batch_buckets(1, 8) == (8,)


def test_resolve_checks_outputs_against_the_model():
    engine = shared_engine()
    resolved = engine.resolve(OutputRequest(patch_layers=(-1, 0, -1)))
    assert resolved.patch_layers == (0, 3)
    for request, reason in [
        (OutputRequest(patch_layers=(4,)), "out of range"),
        (OutputRequest(class_token=True), "no class token"),
        (OutputRequest(logits=True), "no classifier"),
        (OutputRequest(pooled=False), "no outputs"),
    ]:
        with pytest.raises(InvalidRequest, match=reason):
            engine.resolve(request)


def test_resolved_output_sets_are_remembered_and_refusals_repeat():
    engine = shared_engine()
    asked = OutputRequest(patch_layers=(-1, 1))
    assert engine.resolve(asked) is engine.resolve(OutputRequest(patch_layers=(-1, 1)))
    assert engine.resolve(asked) == asked.resolve(engine.cfg)
    for _ in range(2):  # a refusal is not remembered as an answer
        with pytest.raises(InvalidRequest, match="out of range"):
            engine.resolve(OutputRequest(patch_layers=(9,)))


class _Recording:
    """The engine's executor, noting what each batch handed to it looked like."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def check(self) -> None:
        self.inner.check()

    def run(self, engine, bucket, outputs, pixels, active=None):
        self.seen.append((bucket, pixels.ctypes.data % HOST_ALIGN, pixels.copy()))
        return self.inner.run(engine, bucket, outputs, pixels, active)


@pytest.mark.parametrize("rows", [1, 3, 5])
def test_host_batches_are_aligned_and_padded_with_zeros(rows):
    buffer = aligned_empty((16, 64, 64, 3))
    assert buffer.shape == (16, 64, 64, 3) and buffer.dtype == np.float32
    assert buffer.flags.c_contiguous and buffer.flags.writeable
    engine = shared_engine()
    pre = Preprocessor(engine.cfg)
    images = np.stack([pre(p) for p in random_images(rows, seed=rows)])
    recording = engine.executor = _Recording(engine.executor)
    try:
        for _ in range(3):  # several allocations: the allocator's offsets vary
            features = engine.forward(images, engine.resolve(OutputRequest()))
    finally:
        engine.executor = recording.inner
    for bucket, offset, pixels in recording.seen:
        assert bucket == engine.bucket(rows) and offset == 0
        np.testing.assert_array_equal(pixels[:rows], images)
        assert not pixels[rows:].any()  # zeros, not whatever the buffer held
    assert features.pooled.shape[0] == rows


def test_other_output_sets_compile_once_on_demand_and_warm_ones_stay():
    engine = shared_engine()
    pre = Preprocessor(engine.cfg)
    images = np.stack([pre(p) for p in random_images(3, seed=40)])
    outputs = engine.resolve(OutputRequest(pooled=False, attention_stats=True))
    before = engine.compilations
    first = engine.forward(images, outputs)
    second = engine.forward(images, outputs)
    assert engine.compilations == before + 1  # bucket 4, this output set: once
    np.testing.assert_array_equal(first["attention_entropy"], second["attention_entropy"])
    assert {name for name, _ in first.arrays()} == {"attention_entropy", "attention_max_logit"}
    assert not first.patch_tokens
    engine.forward(images, engine.resolve(OutputRequest()))
    assert engine.compilations == before + 1  # pooled was compiled at warm-up


def test_compiled_forwards_are_kept_by_pixel_dtype_and_levels_give_the_same_bits():
    """The server's warm forwards take uint8 levels (what the batcher hands over); normalised
    floats compile their own on demand, and both give the same features bit for bit."""
    engine = shared_engine()
    pre = Preprocessor(engine.cfg)
    levels = np.stack([pre.crop(p) for p in random_images(3, seed=41)])
    pooled, bucket = engine.resolve(OutputRequest()), engine.bucket(3)
    assert engine.is_compiled(bucket, pooled) and engine.is_compiled(bucket, pooled, None, LEVELS)
    before, had_floats = engine.compilations, engine.is_compiled(bucket, pooled, None, NORMALISED)
    of_levels = engine.forward(levels, pooled)
    assert engine.compilations == before  # warm
    normalised = engine.forward(pre.normalise(levels), pooled)
    assert engine.is_compiled(bucket, pooled, None, NORMALISED)
    assert engine.compilations == before + (not had_floats)  # the float32 forward, once
    np.testing.assert_array_equal(of_levels["pooled"], normalised["pooled"])
    for dtype in (np.float64, np.int32, np.float16):
        with pytest.raises(ValueError, match=f"uint8 pixel levels or normalised float32 pixels, "
                                             f"not {np.dtype(dtype)}"):
            engine.forward(levels.astype(dtype), pooled)


def test_the_batcher_takes_levels_only():
    """A float batch would be read as levels or stacked with them: refused at the door."""
    batcher = Batcher(shared_engine(), Metrics())
    pre = Preprocessor(batcher.engine.cfg)
    floats = np.stack([pre(p) for p in random_images(1, seed=42)])
    with pytest.raises(TypeError, match="uint8 pixel levels, not float32"):
        batcher.submit(floats, batcher.engine.resolve(OutputRequest()), None)
    assert not batcher._queue


def test_preprocessing_resizes_the_shorter_side_then_crops_the_centre():
    cfg = get_config("vit-22b-tiny/16")
    pre = Preprocessor(cfg)
    pixels = random_images(1, seed=41, size=(50, 100))[0]  # height 50, width 100
    resize = cfg.preprocess.resize
    resized = np.asarray(
        Image.fromarray(pixels).resize((2 * resize, resize), Image.Resampling.BICUBIC)
    )
    top, left = (resize - 64) // 2, (2 * resize - 64) // 2
    np.testing.assert_array_equal(pre.crop(pixels), resized[top : top + 64, left : left + 64])
    x = pre(pixels)
    assert x.shape == (64, 64, 3) and x.dtype == np.float32
    mean, std = np.asarray(cfg.preprocess.mean), np.asarray(cfg.preprocess.std)
    np.testing.assert_allclose(x, (pre.crop(pixels) / 255.0 - mean) / std, atol=1e-6)
    assert pre.hash == cfg.preprocess_hash()


def test_decode_accepts_jpeg_png_webp_and_names_other_formats():
    pixels = random_images(1, seed=42, size=(20, 30))[0]
    np.testing.assert_array_equal(decode(png(pixels)), pixels)
    for fmt in ("JPEG", "WEBP"):
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format=fmt)
        assert decode(buffer.getvalue()).shape == (20, 30, 3)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PCX")
    with pytest.raises(InvalidImage, match="PCX .* not an accepted format"):
        decode(buffer.getvalue())
    rgba = io.BytesIO()
    Image.fromarray(np.zeros((4, 4, 4), np.uint8)).save(rgba, format="PNG")
    assert (decode(rgba.getvalue()) == 255).all()  # fully transparent: the white background
