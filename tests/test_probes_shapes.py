"""Every probe against its trivial baseline, on shapes-world features of the embedded default.

Features come from the default model ('vit-22b-tiny/16', weights from ``jax.random.key(0)``)
run in-process with the server's preprocessing. Random weights: the probes must still beat
chance, the majority class and the mean depth on held-out images. The figures themselves go in
the reports (``vit22b probe KIND --shapes-world N``), not in asserts.
"""

from functools import partial

import numpy as np
import pytest
from vit22b.probes.data import SHAPES, TEXTURES, shapes_world
from vit22b.probes.features import features_from_model
from vit22b.probes.runner import probe_data_from_shapes_world, run_probe

N = 480
STEPS = 120


@pytest.fixture(scope="module")
def data():
    world = shapes_world(N, seed=0)
    features = features_from_model(world.images, patch_layers=(0, 1, 2, 3), attention_stats=True)
    return probe_data_from_shapes_world(world, features)


def test_shapes_world_is_seeded_and_consistent():
    a, b = shapes_world(12, seed=5), shapes_world(12, seed=5)
    np.testing.assert_array_equal(a.images, b.images)
    np.testing.assert_array_equal(a.depth, b.depth)
    assert not np.array_equal(a.images, shapes_world(12, seed=6).images)
    assert a.images.shape == (12, 64, 64, 3) and a.images.dtype == np.uint8
    assert a.depth.shape == a.mask.shape == (12, 64, 64)
    for i in range(12):
        on_object = a.mask[i] > 0
        assert on_object.any() and not on_object.all()
        assert set(np.unique(a.mask[i])) == {0, a.shape[i] + 1}
        assert (a.depth[i] > 0).all()
    np.testing.assert_array_equal(a.texture, a.shape)  # cues agree by default
    conflict = shapes_world(64, seed=1, texture="conflict")
    assert (conflict.texture != conflict.shape).all()
    assert conflict.shape_names == SHAPES and conflict.texture_names == TEXTURES
    with pytest.raises(ValueError, match="texture"):
        shapes_world(4, texture="plaid")


def test_linear_probe_beats_chance_and_majority(data, tmp_path):
    report = run_probe("linear", data, out_dir=tmp_path)
    base = report["baselines"]
    assert report["top1"] > max(base["chance_top1"], base["majority_top1"])
    assert report["top5"] >= report["top1"]
    assert (tmp_path / "linear.json").is_file()


def test_fewshot_probe_beats_chance(data):
    report = run_probe("fewshot", data)
    chance = report["baselines"]["chance_top1"]
    assert set(report["shots"]) == {"1", "5", "10", "25"}
    for result in report["shots"].values():
        assert result["top1_mean"] > chance
    assert report["shots"]["25"]["top1_mean"] > report["shots"]["1"]["top1_mean"]


def test_knn_probe_beats_chance_and_majority(data):
    report = run_probe("knn", data)
    base = report["baselines"]
    assert set(report["by_k"]) == {"10", "20", "100", "200"}
    for result in report["by_k"].values():
        assert result["top1"] > max(base["chance_top1"], base["majority_top1"])


def test_calibration_probe_keeps_accuracy_and_writes_a_reliability_diagram(data, tmp_path):
    report = run_probe("calibration", data, out_dir=tmp_path)
    assert report["after"]["accuracy"] == report["before"]["accuracy"]
    assert report["before"]["accuracy"] > 1 / len(SHAPES)
    assert report["temperature"] > 0
    assert (tmp_path / "reliability.png").stat().st_size > 1000


def test_depth_decoders_beat_the_mean_depth(data, tmp_path):
    report = run_probe("depth", data, out_dir=tmp_path, steps=STEPS)
    mean = report["baselines"]["mean_depth"]
    for decoder in ("linear", "dpt"):
        assert report[decoder]["rmse"] < mean["rmse"]
        assert report[decoder]["abs_rel"] < mean["abs_rel"]
        assert report[decoder]["delta1"] > mean["delta1"]
    assert (tmp_path / "depth.png").stat().st_size > 1000


def test_a_constant_depth_gives_finite_metrics(data):
    """Standardising a constant depth divided by a zero spread: every RMSE was NaN."""
    from vit22b.probes.dense import depth_probe

    flat = np.full_like(data.depth, 2.5)
    index = np.arange(len(flat))
    report, _ = depth_probe(data.features, flat, index[:40], index[40:80],
                            layers=tuple(data.features.patch_tokens), decoders=("linear",),
                            steps=5)
    metrics = [v for v in report["linear"].values() if isinstance(v, float)]
    assert "rmse" in report["linear"] and metrics and all(np.isfinite(metrics))


def test_pixels_without_a_depth_are_left_out(data):
    """Sensors' holes (0 in KITTI's and NYU's raw maps, NaN elsewhere) made every metric NaN:
    they entered the standardisation, the loss and the metrics. Now a hole is a hole whether
    it holds 0 or NaN, and a split without any measured pixel is refused."""
    from vit22b.probes.dense import depth_probe

    index = np.arange(80)
    holes = np.random.default_rng(0).random(data.depth[:80].shape) < 0.2
    run = partial(depth_probe, data.features, train_index=index[:40], test_index=index[40:80],
                  layers=tuple(data.features.patch_tokens), decoders=("linear",), steps=5)
    as_nan, _ = run(np.where(holes, np.nan, data.depth[:80]))
    as_zero, _ = run(np.where(holes, 0.0, data.depth[:80]))
    assert as_nan == as_zero
    assert as_nan["measured_pixels"] == pytest.approx(0.8, abs=0.01)
    assert all(np.isfinite(v) for v in as_nan["linear"].values())
    unmeasured = data.depth[:80].copy()
    unmeasured[40:] = np.nan
    with pytest.raises(ValueError, match="the test images hold no measured depth"):
        run(unmeasured)


def test_segmentation_decoder_beats_the_majority_class(data, tmp_path):
    report = run_probe("segmentation", data, out_dir=tmp_path, steps=STEPS)
    base = report["baselines"]
    assert report["linear"]["miou"] > base["majority_miou"]
    assert report["linear"]["pixel_accuracy"] > base["majority_pixel_accuracy"]
    assert (tmp_path / "segmentation.png").stat().st_size > 1000


def test_shape_bias_head_decides_by_a_cue_more_often_than_chance(data, tmp_path):
    conflict = shapes_world(160, seed=1, texture="conflict")
    conflict_data = probe_data_from_shapes_world(conflict, features_from_model(conflict.images))
    report = run_probe("shape-bias", conflict_data, train=data, out_dir=tmp_path)
    assert report["conflict_images"] == 160 and report["same_category_excluded"] == 0
    assert report["cue_decision_rate"] > report["chance_cue_decision_rate"]
    counts = report["shape_decisions"] + report["texture_decisions"] + report["other_decisions"]
    assert counts == 160
    assert 0.0 <= report["shape_bias"] <= 1.0
    assert (tmp_path / "shape_bias.png").is_file()


def test_attention_diagnostics_per_layer_and_head(data, tmp_path):
    report = run_probe("diagnostics", data, out_dir=tmp_path)
    entropy = np.asarray(report["entropy_mean"])
    assert entropy.shape == (4, 4)  # depth x heads of the tiny default
    assert (entropy > 0).all() and (entropy <= np.log(16) + 1e-5).all()  # 16 patch tokens
    assert report["uniform_entropy"] == pytest.approx(np.log(16))
    assert np.asarray(report["max_logit_max"]).shape == (4, 4)
    assert (tmp_path / "attention.png").is_file()
