"""The probes on the inputs an outside tester sent (benchmarks/NOTES.md, "The probes under an
outside tester, again"): features files whose numbers, names or headers would have scored
wrongly, taken unbounded memory or ended in a traceback. Each is refused naming what is wrong,
or scored as an independent computation scores it, in bounded memory."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest
from vit22b.clients.cli import main
from vit22b.probes import calibration, dense, diagnostics
from vit22b.probes.data import DataError
from vit22b.probes.features import Features, load_npz_features, save_features
from vit22b.probes.heads import load_head
from vit22b.probes.knn import knn_votes
from vit22b.probes.runner import ProbeData, load_probe_data, run_probe, save_probe_data


def _classes(n_per: int = 20, classes: int = 3, width: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(classes), n_per)
    centres = rng.normal(size=(classes, width)) * 3
    return (centres[labels] + rng.normal(size=(len(labels), width))), labels


def _probe(tmp_path, capsys, kind: str, arrays: dict, *flags: str) -> tuple[int, str]:
    np.savez(tmp_path / "f.npz", **arrays)
    code = main(["probe", kind, "--features", str(tmp_path / "f.npz"), "--out",
                 str(tmp_path / "out"), *flags])
    return code, capsys.readouterr().err


def test_wide_values_float32_cannot_tell_apart_are_refused_not_scored_as_chance(tmp_path, capsys):
    """1e4 + 1e-4 * signal in float64 was one float32 number: kNN and linear scored chance
    (0.333 where scikit-learn on the float64 data scores 0.967), with no word why."""
    x, labels = _classes()
    for values, dtype in ((1e4 + 1e-4 * x, "float64"), (2**30 + np.round(x), "int64")):
        code, err = _probe(tmp_path, capsys, "knn", {
            "pooled": values.astype(dtype), "target/labels": labels})
        assert code == 2 and f"{dtype} values that float32 cannot tell apart" in err, err
    code, _ = _probe(tmp_path, capsys, "knn", {"pooled": x, "target/labels": labels})  # float64
    assert code == 0  # values float32 holds: taken as before


@pytest.mark.parametrize("names, message", [
    (np.array(["a", "a", "b"]), "class 1 and class 0 are both named 'a'"),
    (np.array([0, 1, 2]), "must be a 1-D array of strings, got int64"),
    (np.array([["a", "b", "c"]]), "must be a 1-D array of strings, got <U1 [1, 3]"),
])
def test_class_names_are_distinct_strings(names, message, tmp_path, capsys):
    """Two classes named "a" were merged into the head's one "a" (accuracy 0.333 for 1.0)."""
    x, labels = _classes()
    code, err = _probe(tmp_path, capsys, "knn", {
        "pooled": x, "target/labels": labels, "target/class_names": names})
    assert code == 2 and message in err, err
    np.savez(tmp_path / "head.npz", kernel=np.ones((4, 3), np.float32),
             bias=np.zeros(3, np.float32), class_names=names)
    with pytest.raises(DataError, match="class_names"):
        load_head(tmp_path / "head.npz")


def _forged(path, key: str, shape: tuple[int, ...]) -> None:
    """An .npz whose ``key`` declares ``shape`` in a header over a few bytes of data."""
    header = np.lib.format.header_data_from_array_1_0(np.zeros(1, np.float32))
    header["shape"] = shape
    with zipfile.ZipFile(path, "w") as npz, npz.open(f"{key}.npy", "w") as entry:
        np.lib.format.write_array_header_1_0(entry, header)
        entry.write(b"\0" * 16)


def test_a_header_declaring_more_than_its_entry_holds_is_refused_unread(tmp_path):
    """A 1 KB file declaring a [10^6, 10^5] array ended in numpy's MemoryError traceback."""
    _forged(tmp_path / "bomb.npz", "pooled", (1_000_000, 100_000))
    with pytest.raises(DataError, match=r"'pooled' declares a float32 array of shape "
                                        r"\[1000000, 100000\] \(400,000,000,000 bytes\) in an "
                                        "entry of"):
        load_npz_features(tmp_path / "bomb.npz")
    _forged(tmp_path / "head.npz", "kernel", (100_000, 100_000))
    with pytest.raises(DataError, match="'kernel' declares"):
        load_head(tmp_path / "head.npz")


def test_pickled_arrays_are_refused_naming_file_and_key(tmp_path):
    x, labels = _classes()
    np.savez(tmp_path / "f.npz", pooled=x, **{"target/labels": labels.astype(object)})
    with pytest.raises(DataError, match=r"f.npz: 'target/labels' holds pickled Python objects"):
        load_probe_data(tmp_path / "f.npz")


def test_scalars_where_rows_are_due_are_refused(tmp_path):
    """A 0-d pooled array ended in "len() of unsized object" for every probe."""
    np.savez(tmp_path / "f.npz", pooled=np.float32(1.0))
    with pytest.raises(DataError, match="features pooled must hold one row per image"):
        load_probe_data(tmp_path / "f.npz")
    x, _ = _classes()
    with pytest.raises(DataError, match="labels must hold one entry per image"):
        ProbeData(features=Features(pooled=x.astype(np.float32)), labels=np.int64(1))


def test_scores_of_a_class_index_near_the_cap_take_no_class_by_class_arrays():
    """np.eye(C) and a C x C confusion matrix: 32 GiB for a label of 65,535 (a MemoryError
    traceback), 7 GB for one of 30,000. Each score equals the dense reference on few classes
    and runs on 65,536."""
    rng = np.random.default_rng(1)
    probs = rng.dirichlet(np.ones(5), size=40)
    labels = rng.integers(0, 5, 40)
    assert calibration.brier(probs, labels) == pytest.approx(
        np.mean(np.sum((probs - np.eye(5)[labels]) ** 2, axis=1)))
    pred, target = rng.integers(0, 5, 500), rng.integers(0, 5, 500)
    confusion = np.zeros((5, 5))
    np.add.at(confusion, (target, pred), 1)
    inter = np.diag(confusion)
    iou = inter / (confusion.sum(0) + confusion.sum(1) - inter)
    got = dense.segmentation_metrics(pred, target, 5)
    assert got["miou"] == pytest.approx(iou.mean())
    assert got["pixel_accuracy"] == pytest.approx(inter.sum() / 500)
    big = 65_536
    wide = dense.segmentation_metrics(pred * 13_000, target * 13_000, big)  # classes 0..52,000
    assert wide["miou"] == pytest.approx(got["miou"])
    x = rng.normal(size=(30, 4))
    sparse_labels = np.where(np.arange(30) % 3 == 2, big - 1, np.arange(30) % 3)
    votes = knn_votes(x[:20], sparse_labels[:20], x[20:], (3,), big)[3]
    assert votes.shape == (10, big) and np.isfinite(votes).sum() <= 30
    assert calibration.brier(np.full((3, big), 1 / big), np.array([0, 1, big - 1])) < 1.0


def test_depths_whose_squares_overflow_are_refused_not_reported_as_null(tmp_path):
    """Depths of 1e300: the training depth's spread overflowed, delta1 read 0.0 and the other
    metrics null, exit 0."""
    rng = np.random.default_rng(2)
    tokens = rng.normal(size=(8, 4, 6)).astype(np.float32)
    depth = (1 + rng.random((8, 4, 4))) * 1e300
    data = ProbeData(features=Features(pooled=tokens.mean(1), patch_tokens={0: tokens}),
                     depth=depth)
    with pytest.raises(ValueError, match=r"depths up to 1\.\d+e\+300: their squares overflow"):
        run_probe("depth", data, steps=2, decoders=("linear",))


def test_patch_grids_of_different_layers_are_refused_by_name():
    rng = np.random.default_rng(3)
    tokens = {3: rng.normal(size=(8, 4, 6)), 7: rng.normal(size=(8, 9, 6))}
    features = Features(pooled=rng.normal(size=(8, 6)).astype(np.float32),
                        patch_tokens={k: v.astype(np.float32) for k, v in tokens.items()})
    data = ProbeData(features=features, depth=1 + rng.random((8, 4, 4)))
    with pytest.raises(DataError, match=r"layer 3: 2x2, layer 7: 3x3"):
        run_probe("depth", data, steps=2, decoders=("linear",), layers=(3, 7))


def test_depth_maps_of_an_odd_size_train_at_full_resolution():
    """7x7 maps (KITTI's 375 rows too) were refused: "not divisible by train_stride=2"."""
    rng = np.random.default_rng(7)
    tokens = rng.normal(size=(8, 4, 6)).astype(np.float32)
    data = ProbeData(features=Features(pooled=tokens.mean(1), patch_tokens={0: tokens}),
                     depth=1 + rng.random((8, 7, 7)))
    report = run_probe("depth", data, steps=2, decoders=("linear",))
    assert report["train_stride"] == 1 and np.isfinite(report["linear"]["rmse"])


def test_too_few_images_say_how_many_each_probe_needs():
    """A dense probe on 2 images said "the test images hold no measured depth"; calibration on
    3 images a class got scikit-learn's "Found array with 0 sample(s)"."""
    rng = np.random.default_rng(4)
    tokens = rng.normal(size=(2, 4, 6)).astype(np.float32)
    data = ProbeData(features=Features(pooled=tokens.mean(1), patch_tokens={0: tokens}),
                     depth=1 + rng.random((2, 4, 4)), mask=rng.integers(0, 2, (2, 4, 4)))
    for kind in ("depth", "segmentation"):
        with pytest.raises(DataError, match="2 images are too few: .* 3 images or more"):
            run_probe(kind, data, steps=2, decoders=("linear",))
    x, labels = _classes(n_per=3)
    data = ProbeData(features=Features(pooled=x.astype(np.float32)), labels=labels)
    with pytest.raises(DataError, match="9 labelled images are too few to calibrate"):
        run_probe("calibration", data)


def test_diagnostics_judge_collapse_from_a_saved_file_and_say_when_they_cannot(tmp_path):
    """The number of tokens came only from in-process features: a saved file's collapsed head
    (entropy 0.01 against a uniform 2.2) was never reported."""
    rng = np.random.default_rng(5)
    entropy = np.full((6, 2, 3), 2.0, np.float32)
    entropy[:, 1, 2] = 0.01
    features = Features(attention_entropy=entropy,
                        attention_max_logit=rng.random((6, 2, 3)).astype(np.float32),
                        meta={"num_tokens": 9, "source": "test"})
    save_features(tmp_path / "f.npz", features)
    report = run_probe("diagnostics", ProbeData(features=load_npz_features(tmp_path / "f.npz")))
    assert report["collapsed_heads"] == [{"layer": 1, "head": 2}]
    np.savez(tmp_path / "bare.npz", attention_entropy=entropy,
             attention_max_logit=features.attention_max_logit)
    report = run_probe("diagnostics", ProbeData(features=load_npz_features(tmp_path / "bare.npz")))
    assert report["collapsed_heads"] is None and "collapse_not_judged" in report
    with pytest.raises(DataError, match="negative values"):
        diagnostics.attention_diagnostics(-entropy, features.attention_max_logit, 9)
    with pytest.raises(DataError, match="hold no layer or no head"):
        diagnostics.attention_diagnostics(entropy[:, :0], entropy[:, :0], 9)


def test_test_images_identical_to_training_ones_are_counted(tmp_path, caplog):
    """Random features and labels, each row three times: kNN scored 0.90 (chance 0.20), every
    duplicate found at distance 0 across the split, with no word of it."""
    rng = np.random.default_rng(6)
    x, labels = rng.normal(size=(50, 8)), rng.integers(0, 5, 50)
    data = ProbeData(features=Features(pooled=np.repeat(x, 3, 0).astype(np.float32)),
                     labels=np.repeat(labels, 3))
    save_probe_data(tmp_path / "f.npz", data)
    assert main(["probe", "knn", "--features", str(tmp_path / "f.npz"), "--out",
                 str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "knn.json").read_text())
    assert report["test_rows_seen_in_training"] > 0
    assert "test images have features identical to a training image's" in caplog.text
    fresh = ProbeData(features=Features(pooled=x.astype(np.float32)), labels=labels % 2)
    assert run_probe("knn", fresh)["test_rows_seen_in_training"] == 0


@pytest.mark.parametrize("argv, message", [
    (["calibration", "--bins", "100000"], "positive values of at most 1,000"),
    (["depth", "--steps", "1000000"], "positive values of at most 100,000"),
    (["knn", "--ks", ""], "expected 1 to 64 comma-separated integers, got ''"),
    (["fewshot", "--shots", ",".join(["1"] * 65)], "expected 1 to 64 comma-separated"),
    (["depth", "--train-stride", "0"], "expected positive values of at most 8"),
])
def test_flags_asking_unbounded_work_are_refused(argv, message, tmp_path, capsys):
    """--bins 10^7 ran for minutes into gigabytes; --ks "" ended in "max() arg is an empty
    sequence"."""
    with pytest.raises(SystemExit) as refused:
        main(["probe", *argv, "--digits", "--out", str(tmp_path)])
    assert refused.value.code == 2 and message in capsys.readouterr().err


def _npy(array: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.lib.format.write_array(buf, array)
    return buf.getvalue()


def test_what_the_header_checks_read_is_what_is_loaded(tmp_path):
    """numpy's npz['pooled'] reads a member named 'pooled' before 'pooled.npy': a checked
    'pooled.npy' beside a 64-byte 'pooled' declaring 10^6 x 10^6 ended in a 3.6 TiB MemoryError
    traceback, and two 'pooled.npy' members were read as the second, silently."""
    x, labels = _classes()
    forged = _npy(np.zeros(1, np.float32)).replace(b"(1,)", b"(1000000, 1000000)")
    with zipfile.ZipFile(tmp_path / "both.npz", "w") as npz:
        npz.writestr("pooled.npy", _npy(x))
        npz.writestr("pooled", forged)
    with pytest.raises(DataError, match="two members are named 'pooled'"):
        load_npz_features(tmp_path / "both.npz")
    with zipfile.ZipFile(tmp_path / "twice.npz", "w") as npz, pytest.warns(UserWarning):
        npz.writestr("pooled.npy", _npy(x))
        npz.writestr("pooled.npy", _npy(x[:, :2]))  # zipfile warns: a duplicate name
    with pytest.raises(DataError, match="two members are named 'pooled'"):
        load_npz_features(tmp_path / "twice.npz")
    np.savez(tmp_path / "locked.npz", pooled=x)
    raw = bytearray((tmp_path / "locked.npz").read_bytes())
    for signature, at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):  # "encrypted" flag bits:
        start = raw.index(signature)  # zipfile refuses to read it (a traceback before)
        raw[start + at] |= 0x1
    (tmp_path / "locked.npz").write_bytes(bytes(raw))
    with pytest.raises(DataError, match="locked.npz: not a readable features .npz file"):
        load_npz_features(tmp_path / "locked.npz")


def test_legit_files_the_checks_must_take(tmp_path):
    """Regressions the first checks made: a constant float64 channel (0.1: a float64 spread of
    5e-16, 0 in float32) refused; UTF-8 bytes class names refused by an ASCII decode; another
    tool's pickled 'meta' refusing the whole file; a zero-width array's reshape error."""
    x, labels = _classes()
    x = np.concatenate([x, np.full((len(x), 1), 0.1)], axis=1)  # float64, a constant channel
    names = np.array([n.encode() for n in ("café", "b", "c")])
    np.savez(tmp_path / "f.npz", pooled=x, meta=np.array({"a": 1}, dtype=object),
             **{"target/labels": labels, "target/class_names": names})
    data = load_probe_data(tmp_path / "f.npz")
    assert data.class_names == ("café", "b", "c") and data.features.pooled.shape == x.shape
    np.savez(tmp_path / "latin1.npz", pooled=x,
             **{"target/labels": labels, "target/class_names": np.array([b"caf\xe9", b"b"])})
    with pytest.raises(DataError, match="class_names: bytes that are not UTF-8 text"):
        load_probe_data(tmp_path / "latin1.npz")
    np.savez(tmp_path / "empty.npz", pooled=np.zeros((5, 0)))
    with pytest.raises(DataError, match="have no dimensions"):
        load_probe_data(tmp_path / "empty.npz")


def test_a_depth_decoder_trained_at_half_resolution_is_tested_at_what_it_learned():
    """Trained on 2x2 block means, a decoder's detail within each block is never trained (its
    initial weights' noise): tested at full resolution it scored RMSE 1.43 against a mean-depth
    baseline of 0.98 (0.09 trained at full resolution). Its prediction is made at the training
    resolution and upsampled now. Depth here is one value per token's 4x4 pixels, read off a
    token channel: a linear decoder can learn it."""
    rng = np.random.default_rng(8)
    n, grid = 40, 4
    tokens = rng.normal(size=(n, grid * grid, 16)).astype(np.float32)
    coarse = 5 + tokens[:, :, 0].reshape(n, grid, grid)
    depth = np.repeat(np.repeat(coarse, 4, axis=1), 4, axis=2)
    depth = depth + 0.01 * rng.random(depth.shape)
    train, test = np.arange(30), np.arange(30, 40)
    features = Features(pooled=tokens.mean(1), patch_tokens={0: tokens})
    report, _ = dense.depth_probe(features, depth, train, test, (0,), decoders=("linear",),
                                  steps=100, train_stride=2)
    assert report["train_stride"] == 2
    assert report["linear"]["rmse"] < 0.5 * report["baselines"]["mean_depth"]["rmse"], report


def test_the_dense_probes_train_at_the_stride_asked(tmp_path, capsys):
    rng = np.random.default_rng(9)
    tokens = rng.normal(size=(12, 4, 6)).astype(np.float32)
    data = ProbeData(features=Features(pooled=tokens.mean(1), patch_tokens={0: tokens}),
                     depth=1 + rng.random((12, 8, 8)))
    save_probe_data(tmp_path / "f.npz", data)
    assert main(["probe", "depth", "--features", str(tmp_path / "f.npz"), "--steps", "2",
                 "--decoders", "linear", "--train-stride", "1", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "depth.json").read_text())["train_stride"] == 1
