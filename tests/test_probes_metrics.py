"""Probe metrics against values computed by hand: calibration, shape bias, kNN, ridge, splits."""

import math
import subprocess
import sys

import numpy as np
import pytest
from vit22b.probes import calibration, fewshot, knn, linear, shape_bias
from vit22b.probes.data import DataError
from vit22b.probes.heads import LinearHead, load_head, save_head
from vit22b.probes.metrics import log_softmax, split_indices, topk_accuracy
from vit22b.probes.report import summarize

# ---- calibration ---------------------------------------------------------------------------

# Confidences include exactly 0 (first bin) and exactly 1 (last bin, which is closed).
CONF = np.array([0.0, 0.05, 0.5, 0.52, 0.9, 1.0, 1.0, 0.999])
CORRECT = np.array([0, 1, 1, 0, 1, 1, 0, 1], float)
# 15 equal-width bins of width 1/15:
#   bin 0  {0.0, 0.05}        accuracy 1/2, confidence 0.025     gap 0.475
#   bin 7  {0.5, 0.52}        accuracy 1/2, confidence 0.51      gap 0.01
#   bin 13 {0.9}              accuracy 1,   confidence 0.9       gap 0.1
#   bin 14 {1.0, 1.0, 0.999}  accuracy 2/3, confidence 0.999667  gap 0.333
ECE_BY_HAND = (2 * 0.475 + 2 * 0.01 + 1 * 0.1 + 3 * (2.999 / 3 - 2 / 3)) / 8  # 0.258625
MCE_BY_HAND = 0.475
# Equal mass, 4 bins of 2 after a stable sort by confidence:
#   {0.0:0, 0.05:1} gap 0.475; {0.5:1, 0.52:0} gap 0.01; {0.9:1, 0.999:1} gap 0.0505;
#   {1.0:1, 1.0:0} gap 0.5
ADAPTIVE_4_BY_HAND = (0.475 + 0.01 + 0.0505 + 0.5) / 4  # 0.258875
# With 15 equal-mass bins and 8 samples every sample is its own bin: mean |correct - conf|.
ADAPTIVE_15_BY_HAND = (0 + 0.95 + 0.5 + 0.52 + 0.1 + 0 + 1 + 0.001) / 8  # 0.383875


def test_ece_mce_and_adaptive_ece_match_hand_computed_values():
    assert calibration.ece(CONF, CORRECT) == pytest.approx(ECE_BY_HAND, abs=1e-12)
    assert calibration.mce(CONF, CORRECT) == pytest.approx(MCE_BY_HAND, abs=1e-12)
    assert calibration.adaptive_ece(CONF, CORRECT, bins=4) == pytest.approx(
        ADAPTIVE_4_BY_HAND, abs=1e-12
    )
    assert calibration.adaptive_ece(CONF, CORRECT) == pytest.approx(ADAPTIVE_15_BY_HAND, abs=1e-12)


def test_confidence_one_falls_in_the_last_bin_and_zero_in_the_first():
    bins = calibration.equal_width_bins(np.array([1.0, 0.0, 14 / 15 + 1e-9]), 15)
    assert list(bins[14]) == [0, 2]
    assert list(bins[0]) == [1]
    assert sum(len(b) for b in bins) == 3


def test_metrics_from_probabilities_nll_and_brier():
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]])
    labels = np.array([0, 2])
    metrics = calibration.calibration_metrics(np.log(probs), labels)  # logits of these probs
    assert metrics["accuracy"] == 0.5
    assert metrics["mean_confidence"] == pytest.approx(0.65)
    assert metrics["nll"] == pytest.approx(-(math.log(0.7) + math.log(0.3)) / 2)
    # (0.3^2 + 0.2^2 + 0.1^2 + 0.1^2 + 0.6^2 + 0.7^2) / 2
    assert metrics["brier"] == pytest.approx(0.5)
    # bins: 0.7 -> bin 10 (correct), 0.6 -> bin 9 (wrong): ECE = (0.3 + 0.6) / 2
    assert metrics["ece"] == pytest.approx(0.45)
    assert metrics["mce"] == pytest.approx(0.6)


def _overconfident(n: int, seed: int):
    """Logits of a classifier right about 70% of the time but sure of itself: scaled by 6."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 5, n)
    logits = rng.standard_normal((n, 5)) + 1.5 * np.eye(5)[labels]
    return 6.0 * logits, labels


def test_temperature_scaling_lowers_nll_and_keeps_accuracy():
    val_logits, val_labels = _overconfident(600, seed=1)
    test_logits, test_labels = _overconfident(600, seed=2)
    report = calibration.calibration_probe(val_logits, val_labels, test_logits, test_labels)
    before, after = report["before"], report["after"]
    assert report["temperature"] > 2.0  # the logits were inflated six-fold
    assert after["nll"] < before["nll"]
    assert after["ece"] < before["ece"]
    assert after["accuracy"] == before["accuracy"]
    assert 0.4 < before["accuracy"] < 0.95
    assert len(report["reliability_before"]) == 15


def test_fitted_temperature_recovers_a_known_scale():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4000, 4)) * 2
    labels = np.array([rng.choice(4, p=p) for p in np.exp(logits) / np.exp(logits).sum(1)[:, None]])
    # Labels drawn from softmax(logits): the calibrated temperature of 3 * logits is 3.
    assert calibration.fit_temperature(3 * logits, labels) == (pytest.approx(3.0, rel=0.1), None)


@pytest.mark.parametrize("scale", [1e-6, 1.0, 3000.0, 1e5])
def test_fitted_temperature_is_the_nll_minimum_at_any_scale(scale):
    """The fit searched log T in [-7, 7]: T stopped at 1096.6 for logits scaled by 3000 (the
    minimum is near 1800) and at 9.1e-4 for logits scaled by 1e-6, and the report said nothing."""
    from scipy.optimize import minimize_scalar

    logits, labels = _overconfident(500, seed=4)
    logits = logits * scale
    rows = np.arange(len(labels))

    def nll_at(log_t):
        return -log_softmax(logits / np.exp(log_t))[rows, labels].mean()

    centre = np.log(scale)  # a bounded search around the known scale, as a reference
    best = minimize_scalar(nll_at, bounds=(centre - 8, centre + 8), method="bounded",
                           options={"xatol": 1e-10})
    temperature, limit = calibration.fit_temperature(logits, labels)
    assert limit is None
    assert temperature == pytest.approx(np.exp(best.x), rel=1e-6)
    assert nll_at(np.log(temperature)) <= best.fun + 1e-12


def test_a_temperature_at_a_limit_is_said():
    labels = np.array([0, 1, 2, 0])
    right = 5.0 * np.eye(3)[labels]  # every label has the largest logit: NLL falls as T does
    temperature, limit = calibration.fit_temperature(right, labels)
    assert temperature is None and limit.startswith("T -> 0")
    wrong = -right  # worse than uniform: the best temperature flattens them
    temperature, limit = calibration.fit_temperature(wrong, labels)
    assert temperature is None and limit.startswith("T -> infinity")
    assert calibration.fit_temperature(np.ones((4, 3)), labels) == (
        None, "no fit: the logits are equal within each row (no temperature changes them)")
    # no temperature is applied: "after" is "before" (a T of 1e-12 made one wrong test answer
    # an NLL of 1.8e10, a figure of the search's limit, not of the data)
    test = np.array([[5.0, 0, 0], [0, 5.0, 0], [0, 1.0, 0.9]])
    report = calibration.calibration_probe(right, labels, test, np.array([0, 1, 2]))
    assert report["temperature"] is None and report["temperature_limit"].startswith("T -> 0")
    assert report["after"] == report["before"]
    assert "T=none" in summarize(report) and "T -> 0" in summarize(report)


@pytest.mark.parametrize("scale", [1e-300, 1e-6, 1e6, 1e300])
def test_fitted_temperature_follows_the_logits_scale_to_the_float_limits(scale):
    """The search ran on the raw logits: T = 0.0 below a spread of 6e-297, NaN or a division
    by zero near 1e308. It runs at scale 1 now."""
    logits, labels = _overconfident(300, seed=6)
    unit, limit = calibration.fit_temperature(logits, labels)
    assert limit is None
    assert calibration.fit_temperature(logits * scale, labels) == (
        pytest.approx(unit * scale, rel=1e-9), None)
    assert calibration.fit_temperature(logits + 1e4, labels)[0] == pytest.approx(unit, rel=1e-9)


def test_nll_of_confident_wrong_answers_is_not_clipped():
    """NLL came from probabilities clipped at 1e-300: at most 690.8 a sample."""
    logits = np.array([[1e4, 0.0, -1e4], [0.0, 1e4, 0.0]])
    labels = np.array([2, 1])
    report = calibration.calibration_probe(logits, labels, logits, labels)
    assert report["before"]["nll"] == pytest.approx((2e4 + 0.0) / 2)


# ---- shape bias ----------------------------------------------------------------------------


def test_shape_bias_of_hand_made_decisions():
    names = ("a", "b", "c", "d")
    shapes = np.array([0, 0, 1, 1, 2, 3, 3, 2])
    textures = np.array([1, 0, 2, 3, 0, 3, 0, 1])
    decisions = np.array([0, 0, 2, 3, 1, 3, 0, 2])
    # 0: shape; 1: same category (left out, although it names both); 2, 3: texture;
    # 4: neither; 5: same category (left out); 6: texture; 7: shape.
    report = shape_bias.shape_bias(decisions, shapes, textures, names)
    assert report["shape_decisions"] == 2
    assert report["texture_decisions"] == 3
    assert report["other_decisions"] == 1
    assert report["conflict_images"] == 6
    assert report["same_category_excluded"] == 2
    assert report["shape_bias"] == pytest.approx(2 / 5)
    assert report["cue_decision_rate"] == pytest.approx(5 / 6)
    per = report["per_category"]
    assert per["a"]["shape_bias"] == 1.0 and per["a"]["same_category_excluded"] == 1
    assert per["b"]["shape_bias"] == 0.0 and per["b"]["texture_decisions"] == 2
    assert per["c"]["shape_bias"] == 1.0 and per["c"]["other_decisions"] == 1
    assert per["d"]["shape_bias"] == 0.0 and per["d"]["same_category_excluded"] == 1


def test_shape_bias_without_cue_decisions_is_undefined_not_zero():
    report = shape_bias.shape_bias(np.array([2]), np.array([0]), np.array([1]), ("a", "b", "c"))
    assert report["shape_bias"] is None
    assert report["other_decisions"] == 1


# model-vs-human, modelvshuman/helper/human_categories.py, HumanCategories.<category>_indices
MODEL_VS_HUMAN = {
    "airplane": [404],
    "bear": [294, 295, 296, 297],
    "bicycle": [444, 671],
    "bird": [8, 10, 11, 12, 13, 14, 15, 16, 18, 19, 20, 22, 23, 24, 80, 81, 82, 83, 87, 88, 89,
             90, 91, 92, 93, 94, 95, 96, 98, 99, 100, 127, 128, 129, 130, 131, 132, 133, 135,
             136, 137, 138, 139, 140, 141, 142, 143, 144, 145],
    "boat": [472, 554, 625, 814, 914],
    "bottle": [440, 720, 737, 898, 899, 901, 907],
    "car": [436, 511, 817],
    "cat": [281, 282, 283, 284, 285, 286],
    "chair": [423, 559, 765, 857],
    "clock": [409, 530, 892],
    "dog": [152, 153, 154, 155, 156, 157, 158, 159, 160, 161, 162, 163, 164, 165, 166, 167, 168,
            169, 170, 171, 172, 173, 174, 175, 176, 177, 178, 179, 180, 181, 182, 183, 184, 185,
            186, 187, 188, 189, 190, 191, 193, 194, 195, 196, 197, 198, 199, 200, 201, 202, 203,
            205, 206, 207, 208, 209, 210, 211, 212, 213, 214, 215, 216, 217, 218, 219, 220, 221,
            222, 223, 224, 225, 226, 228, 229, 230, 231, 232, 233, 234, 235, 236, 237, 238, 239,
            240, 241, 243, 244, 245, 246, 247, 248, 249, 250, 252, 253, 254, 255, 256, 257, 259,
            261, 262, 263, 265, 266, 267, 268],
    "elephant": [385, 386],
    "keyboard": [508, 878],
    "knife": [499],
    "oven": [766],
    "truck": [555, 569, 656, 675, 717, 734, 864, 867],
}  # fmt: skip


def test_sixteen_category_mapping_is_model_vs_humans():
    assert shape_bias.CATEGORIES == tuple(sorted(MODEL_VS_HUMAN))
    assert {k: list(v) for k, v in shape_bias.IMAGENET_INDICES.items()} == MODEL_VS_HUMAN
    everything = [i for v in MODEL_VS_HUMAN.values() for i in v]
    assert len(everything) == len(set(everything))  # no ImageNet class in two categories


def test_category_scores_are_mean_probabilities():
    probs = np.full((2, 1000), 0.0)
    dog = shape_bias.IMAGENET_INDICES["dog"]
    probs[0, dog] = 0.5 / len(dog)  # half the mass spread over 109 dog classes ...
    probs[0, 499] = 0.1  # ... loses to a tenth on the one knife class: means, not sums
    probs[1, 404] = 1.0
    scores = shape_bias.imagenet_to_categories(probs)
    names = shape_bias.CATEGORIES
    assert names[scores[0].argmax()] == "knife"
    assert scores[0, names.index("dog")] == pytest.approx(0.5 / 109)
    assert names[scores[1].argmax()] == "airplane"
    with pytest.raises(ValueError, match="1000"):
        shape_bias.imagenet_to_categories(np.ones((1, 999)))


# ---- classification probes ------------------------------------------------------------------


def test_topk_accuracy():
    scores = np.array([[0.1, 0.5, 0.4], [0.6, 0.3, 0.1], [0.2, 0.3, 0.5]])
    labels = np.array([2, 0, 0])
    assert topk_accuracy(scores, labels, 1) == pytest.approx(1 / 3)
    assert topk_accuracy(scores, labels, 2) == pytest.approx(2 / 3)
    assert topk_accuracy(scores, labels, 5) == 1.0  # k beyond the classes: all


def test_knn_votes_are_temperature_weighted_cosine_similarities():
    train = np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0], [-1.0, 0.0]])
    labels = np.array([0, 1, 1, 0])
    query = np.array([[2.0, 0.5]])
    votes = knn.knn_votes(train, labels, query, ks=(1, 2, 10), num_classes=2, temperature=0.5)
    unit = train / np.linalg.norm(train, axis=1, keepdims=True)
    sims = unit @ (query[0] / np.linalg.norm(query))
    # neighbours by similarity: 0 (class 0), 2 (class 1), 1 (class 1), 3 (class 0)
    w = np.exp(sims / 0.5) / np.exp(sims[0] / 0.5)  # each row over its nearest's weight
    np.testing.assert_allclose(votes[1][0], [w[0], -np.inf], rtol=1e-5)  # float32 similarities
    np.testing.assert_allclose(votes[2][0], [w[0], w[2]], rtol=1e-5)
    np.testing.assert_allclose(votes[10][0], [w[0] + w[3], w[1] + w[2]], rtol=1e-5)  # k <= 4


def test_knn_top5_counts_only_classes_a_neighbour_voted_for():
    """Classes without a vote filled the top 5, lowest index first: with k = 1 a label 0 that
    no neighbour had was a top-5 hit."""
    assert topk_accuracy(np.array([[-np.inf] * 7 + [5.0, 3.0, -np.inf]]), np.array([0]), 5) == 0
    train = np.eye(10)[:8]  # one point per class 0..7
    # nearest: class 7, then 1, 2, ..., 6; class 0 is the farthest, and the label
    test = np.array([[0.0, 0.06, 0.05, 0.04, 0.03, 0.02, 0.01, 1.0, 0.0, 0.0]])
    report = knn.knn_probe(train, np.arange(8), test, np.array([0]), ks=(1, 3, 8))["by_k"]
    assert report["1"]["top5"] == 0.0 and report["3"]["top5"] == 0.0
    assert report["8"]["top5"] == 0.0  # 8 classes voted; class 0 is not among the 5 best
    assert report["8"]["top1"] == 0.0


def test_linear_top5_never_counts_a_class_training_did_not_have():
    """The linear probe scores classes training never saw -inf; with fewer than five seen
    classes they filled its top 5, so a test label no training image had was a top-5 hit."""
    rng = np.random.default_rng(0)
    train_x, train_y = rng.standard_normal((60, 4)), np.arange(60) % 3
    report = linear.linear_probe(train_x, train_y, rng.standard_normal((5, 4)), np.full(5, 3))
    assert report["top1"] == 0.0 and report["top5"] == 0.0


def test_knn_votes_at_small_temperatures_keep_their_order():
    """exp(s / T) overflowed at T = 0.001 (exp(1000) is infinite): every class a near
    neighbour reached tied, and the lowest index won."""
    train = np.array([[1.0, 0.0], [1.0, 0.15], [1.0, 0.16]])
    labels = np.array([1, 0, 0])
    query = np.array([[1.0, 0.0]])  # nearest: class 1 (1.0); class 0's two at about 0.989
    for temperature, winner in ((0.07, 0), (1e-3, 1), (1e-6, 1)):  # two near votes, or one
        votes = knn.knn_votes(train, labels, query, ks=(3,), num_classes=2,
                              temperature=temperature)[3]
        assert np.all(np.isfinite(votes)) and votes[0].argmax() == winner
        report = knn.knn_probe(train, labels, query, np.array([winner]), ks=(3,),
                               temperature=temperature)
        assert report["by_k"]["3"]["top1"] == 1.0


def _blobs(n: int, classes: int, dim: int, seed: int, spread: float = 1.0):
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((classes, dim)) * 3
    labels = rng.integers(0, classes, n)
    return centres[labels] + spread * rng.standard_normal((n, dim)), labels


@pytest.mark.parametrize("n_per_class", [3, 40])  # fewer and more points than dimensions
def test_ridge_classifier_matches_the_normal_equations(n_per_class):
    x, y = _blobs(4 * n_per_class, 4, 20, seed=3)
    y = np.repeat(np.arange(4), n_per_class)
    predict = fewshot.ridge_classifier(x, y, 4, l2=8.0)
    mean, std = x.mean(0), x.std(0) + 1e-5

    def design(v):
        return np.pad((v - mean) / std, ((0, 0), (0, 1)), constant_values=fewshot.BIAS_FEATURE)

    a = design(x)
    w = np.linalg.solve(a.T @ a + 8.0 * np.eye(a.shape[1]), a.T @ (2 * np.eye(4)[y] - 1))
    test = np.random.default_rng(9).standard_normal((5, 20))
    np.testing.assert_allclose(predict(test), design(test) @ w, rtol=1e-6, atol=1e-8)


def test_fewshot_reports_mean_and_spread_and_skips_impossible_shots():
    x, y = _blobs(300, 3, 16, seed=4)
    report = fewshot.fewshot_probe(x[:200], y[:200], x[200:], y[200:], shots=(1, 5, 500))
    assert set(report["shots"]) == {"1", "5"}
    assert "500" in report["skipped"]
    five = report["shots"]["5"]
    assert len(five["top1_per_seed"]) == 3
    assert five["top1_mean"] == pytest.approx(np.mean(five["top1_per_seed"]))
    assert five["top1_std"] == pytest.approx(np.std(five["top1_per_seed"]))
    assert five["top1_mean"] > 0.9  # well separated blobs


def test_linear_probe_sweeps_c_and_scores_held_out_data():
    x, y = _blobs(400, 5, 10, seed=5, spread=2.0)
    report = linear.linear_probe(x[:300], y[:300], x[300:], y[300:])
    assert report["best_C"] in linear.DEFAULT_CS
    assert set(report["val_top1_by_C"]) == {f"{c:g}" for c in linear.DEFAULT_CS}
    assert report["top1"] > 0.8
    assert report["top5"] == 1.0  # five classes
    assert report["top1"] > report["baselines"]["majority_top1"]


def test_stratified_split_is_a_partition_that_keeps_class_shares():
    labels = np.repeat([0, 1, 2], [50, 30, 20])
    parts = split_indices(labels, (0.6, 0.2, 0.2), seed=0)
    joined = np.concatenate(parts)
    assert sorted(joined) == list(range(100))
    assert [len(p) for p in parts] == [60, 20, 20]
    assert np.bincount(labels[parts[1]]).tolist() == [10, 6, 4]
    with pytest.raises(ValueError):
        split_indices(labels, (0.5, 0.4))


# ---- imported heads -------------------------------------------------------------------------


def test_head_file_round_trip_and_logits(tmp_path):
    rng = np.random.default_rng(0)
    head = LinearHead(rng.standard_normal((8, 3)).astype(np.float32),
                      np.arange(3, dtype=np.float32), ("x", "y", "z"))  # fmt: skip
    save_head(tmp_path / "head.npz", head)
    loaded = load_head(tmp_path / "head.npz")
    assert loaded.class_names == ("x", "y", "z")
    pooled = rng.standard_normal((4, 8)).astype(np.float32)
    np.testing.assert_allclose(loaded.logits(pooled), pooled @ head.kernel + head.bias, rtol=1e-6)
    with pytest.raises(DataError, match="input width 8"):
        loaded.logits(np.ones((2, 7), np.float32))


_SAVE_CAPPED = """
import resource, signal, sys
import numpy as np
from vit22b.probes.heads import LinearHead, save_head
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the cap fails with EFBIG, as ENOSPC
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
try:
    save_head(sys.argv[1], LinearHead(np.ones((256, 256), np.float32), np.zeros(256, np.float32)))
except OSError as err:
    print(err)
"""


def test_a_head_write_that_fails_leaves_the_old_head(tmp_path):
    """np.savez wrote in place: a full disk left a truncated head under the final name."""
    old = LinearHead(np.eye(4, 2, dtype=np.float32), np.zeros(2, np.float32), ("a", "b"))
    assert save_head(tmp_path / "head", old) == tmp_path / "head.npz"  # np.savez's naming
    out = subprocess.run([sys.executable, "-c", _SAVE_CAPPED, str(tmp_path / "head.npz")],
                         capture_output=True, text=True, timeout=120)
    assert "File too large" in out.stdout and "head.npz" in out.stdout, out
    kept = load_head(tmp_path / "head.npz")
    np.testing.assert_array_equal(kept.kernel, old.kernel)
    assert kept.class_names == ("a", "b")
    assert [p.name for p in tmp_path.iterdir()] == ["head.npz"]  # no temporary left


def test_bad_head_files_are_refused_with_the_reason(tmp_path):
    np.savez(tmp_path / "nobias.npz", kernel=np.ones((4, 2), np.float32))
    with pytest.raises(DataError, match=r"lacks \['bias'\]"):
        load_head(tmp_path / "nobias.npz")
    np.savez(tmp_path / "shape.npz", kernel=np.ones((4, 2), np.float32), bias=np.ones(3))
    with pytest.raises(DataError, match="does not match kernel"):
        load_head(tmp_path / "shape.npz")
    np.savez(tmp_path / "ints.npz", kernel=np.ones((4, 2), np.int32), bias=np.ones(2))
    with pytest.raises(DataError, match="floating point"):
        load_head(tmp_path / "ints.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match="junk.npz"):
        load_head(tmp_path / "junk.npz")
    (tmp_path / "zip.npz").write_bytes(b"PK\x03\x04 not a zip after all")  # BadZipFile crashed
    with pytest.raises(DataError, match="zip.npz: not a readable .npz head file"):
        load_head(tmp_path / "zip.npz")
    kernel = np.ones((4, 2), np.float32)
    kernel[1, 1] = np.nan  # a corrupt download: every decision was NaN
    np.savez(tmp_path / "nan.npz", kernel=kernel, bias=np.ones(2))
    with pytest.raises(DataError, match="nan.npz: head kernel holds 1 NaN or infinite values"):
        load_head(tmp_path / "nan.npz")
    np.savez(tmp_path / "big.npz", kernel=np.full((4, 2), 1e300), bias=np.ones(2))
    with pytest.raises(DataError, match="head kernel holds 8 NaN or infinite"):  # as float32
        load_head(tmp_path / "big.npz")
    head = LinearHead(np.full((4, 2), 1e30, np.float32), np.zeros(2, np.float32))
    with pytest.raises(DataError, match="the head's logits overflow float32"):
        head.logits(np.full((3, 4), 1e20, np.float32))


def test_calibration_refuses_what_is_not_a_confidence_or_a_bin_count():
    for bins in (0, -2, 1.5):
        with pytest.raises(ValueError, match="bins must be a positive integer"):
            calibration.ece([0.5], [1], bins)
    for confidence in ([float("nan"), 0.5], [1.2, 0.5]):
        with pytest.raises(ValueError, match=r"probabilities in \[0, 1\]"):
            calibration.adaptive_ece(confidence, [1, 0])
    with pytest.raises(ValueError, match="one confidence per prediction"):
        calibration.mce([0.5, 0.5], [1])


def test_segmentation_metrics_of_uint8_masks_and_refused_classes():
    from vit22b.probes.dense import segmentation_metrics

    target = np.array([[0, 1, 2], [2, 1, 0]], np.uint8)  # as masks are read
    perfect = segmentation_metrics(target, target, 3)  # uint8 * 3 overflowed before
    assert perfect["pixel_accuracy"] == 1.0 and perfect["miou"] == 1.0
    with pytest.raises(ValueError, match=r"prediction classes must be in 0..2, got 0..5"):
        segmentation_metrics(np.array([0, 1, 5]), np.array([0, 1, 2]), 3)


def test_segmentation_metrics_leave_the_ignore_index_out():
    from vit22b.probes.dense import segmentation_metrics

    target = np.array([[0, 1, 255], [255, 1, 0]], np.uint8)  # a VOC-style border label
    pred = np.array([[0, 0, 1], [0, 1, 0]])  # 3 of the 4 labelled pixels right
    scored = segmentation_metrics(pred, target, 2, ignore_index=255)
    assert scored["pixel_accuracy"] == 0.75
    # class 0: 2 right of 3 predicted or labelled; class 1: 1 of 2
    assert scored["iou_per_class"] == [2 / 3, 1 / 2]
    with pytest.raises(ValueError, match=r"target classes must be in 0..1, got 0..255"):
        segmentation_metrics(pred, target, 2)  # without it, 255 is an unknown class
    with pytest.raises(ValueError, match=r"got 0..7 \(pixels labelled 255 are ignored\)"):
        segmentation_metrics(pred, np.where(target == 1, 7, target), 2, ignore_index=255)
    with pytest.raises(ValueError, match="every target pixel is ignored"):
        segmentation_metrics(pred, np.full_like(target, 255), 2, ignore_index=255)


def test_pixel_cross_entropy_counts_only_labelled_pixels():
    import jax.numpy as jnp
    from vit22b.probes.dense import pixel_cross_entropy

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 3, 4)).astype(np.float32)
    labels = rng.integers(0, 4, (2, 3, 3))
    labels[0, 0, :] = 255
    counted = labels != 255
    shifted = logits - logits.max(-1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_p, np.where(counted, labels, 0)[..., None], -1)[..., 0]
    loss = pixel_cross_entropy(jnp.asarray(logits), jnp.asarray(labels), 255)
    np.testing.assert_allclose(float(loss), expected[counted].mean(), rtol=1e-6)
    changed = logits.copy()
    changed[0, 0, :] += 50.0  # logits where the label is ignored do not matter
    assert float(pixel_cross_entropy(jnp.asarray(changed), jnp.asarray(labels), 255)) == float(loss)
    assert float(pixel_cross_entropy(jnp.asarray(changed), jnp.asarray(labels) % 4)) != float(loss)


def test_probe_targets_must_align_with_the_features():
    from vit22b.model.features import Features
    from vit22b.probes.runner import ProbeData

    features = Features(pooled=np.zeros((6, 4), np.float32))
    ProbeData(features, labels=np.arange(6))
    with pytest.raises(DataError, match="labels has 4 entries for 6 images"):
        ProbeData(features, labels=np.arange(4))  # rows after the gap would be misaligned
    with pytest.raises(DataError, match="labels must be integer class indices, got dtype <U1"):
        ProbeData(features, labels=np.array(list("abcabc")))
    with pytest.raises(DataError, match="depth has 5 entries"):
        ProbeData(features, depth=np.zeros((5, 2, 2)))
    holed = features.pooled.copy()
    holed[3, 1] = np.nan  # a kNN probe scored such rows as if they were features
    with pytest.raises(DataError, match="features pooled hold NaN or infinite values"):
        ProbeData(Features(pooled=holed), labels=np.arange(6))


def _sets(seed: int = 0, n: int = 24, d: int = 6, classes: int = 3):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, d)).astype(np.float32), np.arange(n) % classes,
            rng.standard_normal((9, d)).astype(np.float32), np.arange(9) % classes)


def _nan_row(x):
    x = x.copy()
    x[4, 2] = np.nan
    return x


PROBES = {"linear": linear.linear_probe, "knn": knn.knn_probe, "fewshot": fewshot.fewshot_probe}
BAD_SETS = {  # (what is changed, the words of the refusal)
    "labels short": (lambda s: (s[0], s[1][:-1], s[2], s[3]),
                     r"training labels must be one per row of features: \[23\] labels for 24"),
    "NaN feature": (lambda s: (_nan_row(s[0]), *s[1:]),
                    r"training features: 1 of 24 rows hold NaN or Inf \(the first: row 4\)"),
    "Inf in test": (lambda s: (*s[:2], s[2] * np.float32(np.inf), s[3]),
                    r"test features: 9 of 9 rows hold NaN or Inf"),
    "widths differ": (lambda s: (s[0], s[1], s[2][:, :5], s[3]),
                      "training features have 6 dimensions, test features 5"),
    "no test": (lambda s: (*s[:2], s[2][:0], s[3][:0]), "the test set is empty"),
    "no training": (lambda s: (s[0][:0], s[1][:0], *s[2:]), "the training set is empty"),
    "negative label": (lambda s: (s[0], s[1] - 1, *s[2:]), "class indices >= 0, got -1"),
    "fractional labels": (lambda s: (s[0], s[1] + 0.5, *s[2:]),
                          "integer class indices 0..C-1, got float64"),
    "string labels": (lambda s: (s[0], s[1].astype(str), *s[2:]), "integer class indices"),
    "3-d features": (lambda s: (s[0].reshape(24, 3, 2), *s[1:]), r"a real \[N, D\] array"),
}


@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.parametrize("case", BAD_SETS)
def test_probes_refuse_unusable_sets_by_name_instead_of_scoring_them(probe, case):
    """A probe given features and labels that cannot be scored says which set and what is
    wrong; before, kNN scored NaN features and an empty training set, few-shot mismatched
    lengths, and the rest failed deep inside scikit-learn or numpy."""
    change, words = BAD_SETS[case]
    with pytest.raises(ValueError, match=words):
        PROBES[probe](*change(_sets()))


def test_integral_float_labels_and_huge_features_are_scored_as_their_integers():
    train_x, train_y, test_x, test_y = _sets()
    want = knn.knn_probe(train_x, train_y, test_x, test_y)
    assert knn.knn_probe(train_x, train_y.astype(float), test_x, test_y.astype(float)) == want
    # unit vectors of values near 1e30: their float32 norm overflowed, every vector became 0
    scaled = knn.knn_probe(train_x * np.float32(1e30), train_y, test_x * np.float32(1e30), test_y)
    assert scaled["by_k"] == want["by_k"]


def test_linear_probe_needs_images_on_both_sides_of_its_split():
    train_x, _, test_x, test_y = _sets(n=3)
    with pytest.raises(ValueError, match="sweeps C on the rest: that needs 2 classes or more "
                                         r"with images on both sides \(the training set has 3 "
                                         "classes, the largest 1 images\\)"):
        linear.linear_probe(train_x, np.arange(3), test_x, test_y)


def test_calibration_refuses_labels_beyond_its_logits():
    rng = np.random.default_rng(1)
    logits, labels = rng.standard_normal((30, 5)), np.arange(30) % 5
    report = calibration.calibration_probe(logits, labels, logits, labels)
    assert report["temperature_limit"].startswith("T -> infinity")  # random logits
    with pytest.raises(ValueError, match=r"logits of 5 \(validation\) and 5 \(test\) classes "
                                         "for labels up to 5"):
        calibration.calibration_probe(logits, labels + 1, logits, labels)
    with pytest.raises(ValueError, match="validation logits: 1 of 30 rows hold NaN"):
        calibration.calibration_probe(_nan_row(logits), labels, logits, labels)


def test_a_dataset_too_small_to_test_on_says_so():
    from vit22b.probes.runner import _splits

    with pytest.raises(ValueError, match="2 labelled images are too few to test on: the probes "
                                         "hold out 20% of each class"):
        _splits(np.array([0, 1]), 0)
    train, val, test = _splits(np.array([0, 0, 0, 1]), 0)
    assert len(test) == 1 and len(train) + len(val) == 3


def _probe_data(n: int = 30, d: int = 4, **targets):
    from vit22b.probes.features import Features
    from vit22b.probes.runner import ProbeData

    rng = np.random.default_rng(0)
    return ProbeData(Features(pooled=rng.standard_normal((n, d)).astype(np.float32)), **targets)


BAD_DATA = {  # the ProbeData a probe never sees, and the words of the refusal
    "a label of 10^12": (dict(labels=np.r_[np.arange(29) % 3, 10**12]),
                         r"labels: class index 1000000000000 \(image 29\) is too large"),
    "labels of two columns": (dict(labels=np.zeros((30, 2), int)),
                              r"labels must be one class index per image, got shape \[30, 2\]"),
    "a negative texture": (dict(texture=np.arange(30) - 1),
                           r"texture: class index -1 \(image 0\) is negative"),
    "fewer names than classes": (dict(labels=np.arange(30) % 10, class_names=("a", "b")),
                                 "2 class names for labels up to 9"),
    "depth of one row per image": (dict(depth=np.ones((30, 8))),
                                   r"depth must be one \[H, W\] map per image"),
    "complex depth": (dict(depth=np.ones((30, 2, 2), np.complex64)),
                      "depth must be real numbers, got dtype complex64"),
    "a mask of one row per image": (dict(mask=np.zeros((30, 8), np.uint8)),
                                    r"mask must be one \[H, W\] map per image"),
    "10^12 mask classes": (dict(mask=np.zeros((30, 2, 2), np.uint8), num_mask_classes=10**12),
                           "num_mask_classes must be in 1..65,536, got 1000000000000"),
}


@pytest.mark.parametrize("case", BAD_DATA)
def test_targets_a_probe_cannot_use_are_refused_by_name(case):
    """Before: a label of 10^12 asked for 10^12 columns of scores (MemoryError), labels of two
    columns and maps of the wrong rank failed with IndexError deep in a probe, fewer class
    names than classes were taken, 10^12 mask classes exhausted JAX's memory."""
    targets, words = BAD_DATA[case]
    with pytest.raises(DataError, match=words):
        _probe_data(**targets)


def test_features_a_probe_cannot_use_are_refused_by_name():
    from vit22b.model.features import Features
    from vit22b.probes.features import features_from_outputs
    from vit22b.probes.runner import ProbeData

    x = np.ones((6, 4), np.float32)
    with pytest.raises(DataError, match="features pooled must be real numbers, got dtype "
                                        "complex64"):  # a float32 cast dropped the imaginary parts
        features_from_outputs({"pooled": x.astype(np.complex64)})
    with pytest.raises(DataError, match="must be real numbers, got dtype bool"):
        features_from_outputs({"pooled": x > 0})
    with pytest.raises(DataError, match=r"features pooled have no dimensions: shape \[6, 0\]"):
        ProbeData(Features(pooled=x[:, :0]))
    with pytest.raises(DataError, match="the features hold no images"):
        ProbeData(Features(pooled=x[:0]))
    tokens = {3: np.ones((5, 4, 4), np.float32)}
    with pytest.raises(DataError, match="features patch_tokens.3. hold 5 rows for 6 images"):
        ProbeData(Features(pooled=x, patch_tokens=tokens))


def test_a_file_that_is_not_a_features_npz_is_named(tmp_path):
    from vit22b.probes.runner import load_probe_data

    path = tmp_path / "features.npz"
    path.write_bytes(b"PK\x03\x04 not a zip archive")
    with pytest.raises(DataError, match=f"{path}: not a readable features .npz file"):
        load_probe_data(path)
    np.savez(path, pooled=np.ones((6, 4), np.float32), **{"patch_tokens/x": np.ones((6, 4, 4))})
    with pytest.raises(DataError, match="'patch_tokens/x' names no layer"):
        load_probe_data(path)
    np.savez(path, pooled=np.ones((6, 4), np.float32),
             **{"target/num_mask_classes": np.array([1, 2])})
    with pytest.raises(DataError, match=r"num_mask_classes must be one integer, got int64 \[2\]"):
        load_probe_data(path)


@pytest.mark.parametrize("kind", ["linear", "fewshot", "knn", "calibration"])
def test_a_classifier_needs_two_classes(kind):
    """Few-shot and kNN scored images of one class as 1.0 against a chance of 1.0."""
    from vit22b.probes.runner import run_probe

    with pytest.raises(DataError, match=f"the {kind} probe.* needs images of 2 classes or more; "
                                        "all 30 are of class 4"):
        run_probe(kind, _probe_data(labels=np.full(30, 4)))


def test_a_class_index_no_image_has_leaves_the_others_scored():
    """Labels 0, 1 and 3 (no image of class 2): few-shot skipped every number of shots and
    reported nothing with exit 0 (its classes 0..3 included the empty one), calibration refused
    its own -inf logits of class 2."""
    from vit22b.probes.runner import run_probe

    labels = np.array([0, 1, 3] * 20)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((60, 6)).astype(np.float32) + 3 * np.eye(6, dtype=np.float32)[labels]
    data = _probe_data(n=60, d=6, labels=labels)
    data.features.pooled[:] = x
    shots = run_probe("fewshot", data, shots=(1, 5))["shots"]
    assert set(shots) == {"1", "5"} and shots["5"]["top1_mean"] > 0.5
    report = run_probe("calibration", data)
    assert np.isfinite(report["before"]["nll"]) and report["before"]["accuracy"] > 0.5
    with pytest.raises(ValueError, match=r"no number of shots in \[50\] fits: the smallest "
                                         "class has 16 training images"):
        run_probe("fewshot", data, shots=(50,))


def test_an_imported_heads_classes_are_matched_to_the_images_by_name():
    """A head naming its classes in another order than the images' folders (or shape-bias
    categories) was read by position: the folder sorting first was the head's class 0."""
    from vit22b.probes.runner import run_probe
    from vit22b.probes.shape_bias import CATEGORIES

    rng = np.random.default_rng(0)
    kernel, bias = rng.standard_normal((4, 3)).astype(np.float32), np.zeros(3, np.float32)
    data = _probe_data(n=60, labels=np.arange(60) % 3, class_names=("cat", "dog", "owl"))
    as_named = LinearHead(kernel, bias, ("cat", "dog", "owl"))
    reordered = LinearHead(kernel[:, [2, 0, 1]], bias, ("owl", "cat", "dog"))  # same head
    want = run_probe("calibration", data, head=as_named)
    got = run_probe("calibration", data, head=reordered)  # columns summed in another order
    for key in ("before", "after"):
        assert got[key] == pytest.approx(want[key], rel=1e-9)
    assert got["temperature_limit"] == want["temperature_limit"]
    assert got["temperature"] == (None if want["temperature"] is None else
                                  pytest.approx(want["temperature"], rel=1e-6))
    positional = run_probe("calibration", data, head=LinearHead(kernel[:, [2, 0, 1]], bias))
    assert positional["before"]["nll"] != want["before"]["nll"]  # without names: by position
    with pytest.raises(DataError, match="the head has no class named 'owl'"):
        run_probe("calibration", data, head=LinearHead(kernel, bias, ("cat", "dog", "emu")))

    order = rng.permutation(16)
    wide = rng.standard_normal((4, 16)).astype(np.float32)
    conflict = _probe_data(n=32, labels=np.arange(32) % 16, texture=(np.arange(32) + 1) % 16,
                           class_names=CATEGORIES)
    by_name = run_probe("shape-bias", conflict, head=LinearHead(wide, np.zeros(16, np.float32),
                                                                CATEGORIES))
    shuffled = LinearHead(wide[:, order], np.zeros(16, np.float32),
                          tuple(CATEGORIES[i] for i in order))
    again = run_probe("shape-bias", conflict, head=shuffled)
    assert again["shape_bias"] == by_name["shape_bias"]
    assert "matched to the categories by name" in again["decisions_from"]
