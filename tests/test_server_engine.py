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
