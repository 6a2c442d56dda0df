"""Run a probe end to end on a :class:`ProbeData`: split, fit, score, write JSON and PNG.

This is the library entry the CLI (``vit22b probe KIND``) and the demo call; each probe module
stays a pure function of arrays.
"""

from __future__ import annotations

import logging
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import calibration, diagnostics, fewshot, knn, linear, plots, shape_bias
from .data import IGNORE_INDEX, DataError, ShapesWorld
from .features import (
    Features,
    check_finite,
    feature_arrays,
    load_npz_features,
    read_npz,
    write_npz,
)
from .heads import LinearHead
from .metrics import (
    MAX_CLASSES,
    check_class_indices,
    check_class_names,
    class_name_list,
    log_softmax,
    split_indices,
    two_classes,
)
from .report import write_report

log = logging.getLogger(__name__)

KINDS = (
    "linear", "fewshot", "knn", "calibration", "depth", "segmentation", "shape-bias", "diagnostics",
    "video",
)  # fmt: skip


_TARGETS = ("labels", "texture", "depth", "mask")
_CLASSES = ("labels", "texture", "mask")


@dataclass
class ProbeData:
    """Features of N images with whatever targets the probes need (all aligned on N)."""

    features: Features
    labels: np.ndarray | None = None  # class (for cue-conflict images: shape category)
    class_names: tuple[str, ...] = ()
    texture: np.ndarray | None = None  # texture category of cue-conflict images
    depth: np.ndarray | None = None  # [N, H, W]
    mask: np.ndarray | None = None  # [N, H, W], 0..num_mask_classes-1
    num_mask_classes: int | None = None
    images: np.ndarray | None = None  # uint8 [N, H, W, 3], for figures only

    def __post_init__(self) -> None:
        """Features are finite and of some width, every target has one entry per image, and
        the class-like ones are integer indices of a bounded number of classes
        (``check_class_indices``; a shorter list of labels would misalign every row after the
        gap)."""
        rows = len(self.features)
        if not rows:
            raise DataError("the features hold no images")
        tokens = {f"patch_tokens[{k}]": v for k, v in self.features.patch_tokens.items()}
        for name, array in (*self.features.arrays(), *tokens.items()):
            if len(array) != rows:
                raise DataError(f"features {name} hold {len(array)} rows for {rows} images")
            if name.startswith("patch_tokens") and array.ndim != 3:
                raise DataError(f"features {name} must be [images, patches, width], got shape "
                                f"{list(array.shape)}")
            if array.ndim > 1 and not array.shape[-1]:
                raise DataError(f"features {name} have no dimensions: shape {list(array.shape)}")
            check_finite(array, name)
        for name in (*_TARGETS, "images"):
            value = getattr(self, name)
            if value is None:
                continue
            if not np.ndim(value):
                raise DataError(f"{name} must hold one entry per image, got a single value")
            if len(value) != rows:
                raise DataError(f"{name} has {len(value)} entries for {rows} images: one per "
                                "image, in the features' order")
            value = np.asarray(value)
            if name in ("depth", "mask") and value.ndim != 3:
                raise DataError(f"{name} must be one [H, W] map per image ([N, H, W]), got "
                                f"shape {list(value.shape)}")
            if name == "depth" and not (np.issubdtype(value.dtype, np.floating)
                                        or np.issubdtype(value.dtype, np.integer)):
                raise DataError(f"depth must be real numbers, got dtype {value.dtype}")
            if name in _CLASSES:
                check_class_indices(name, value, per_image=name != "mask")
        if self.num_mask_classes is not None and not 1 <= self.num_mask_classes <= MAX_CLASSES:
            raise DataError(f"num_mask_classes must be in 1..{MAX_CLASSES:,}, got "
                            f"{self.num_mask_classes}")
        if self.labels is not None:
            check_class_names(self.class_names, np.asarray(self.labels))

    def require(self, name: str, why: str) -> np.ndarray:
        value = getattr(self, name)
        if value is None:
            raise DataError(f"the {why} needs {name} for the images, and this data has none")
        return value


def probe_data_from_shapes_world(world: ShapesWorld, features: Features) -> ProbeData:
    return ProbeData(
        features=features,
        labels=world.shape,
        class_names=world.shape_names,
        texture=world.texture,
        depth=world.depth,
        mask=world.mask,
        num_mask_classes=world.num_mask_classes,
        images=world.images,
    )




def save_probe_data(path: str | Path, data: ProbeData) -> None:
    """Features and targets in one .npz (``target/<name>``), reloadable with ``--features``."""
    arrays = feature_arrays(data.features)
    for name in _TARGETS:
        if getattr(data, name) is not None:
            arrays[f"target/{name}"] = getattr(data, name)
    if data.class_names:
        arrays["target/class_names"] = np.asarray(data.class_names, dtype=str)
    if data.num_mask_classes:
        arrays["target/num_mask_classes"] = np.asarray(data.num_mask_classes)
    write_npz(path, arrays)


def load_probe_data(path: str | Path) -> ProbeData:
    features = load_npz_features(path)
    targets = {k.split("/", 1)[1]: v for k, v in
               read_npz(path, "features .npz", lambda k: k.startswith("target/")).items()}
    names = class_name_list(targets.pop("class_names", np.asarray([], str)), f"{path}: "
                            "target/class_names")
    num_mask = targets.pop("num_mask_classes", None)
    if num_mask is not None and (num_mask.shape or not np.issubdtype(num_mask.dtype, np.integer)):
        raise DataError(f"{path}: target/num_mask_classes must be one integer, got "
                        f"{num_mask.dtype} {list(num_mask.shape)}")
    return ProbeData(
        features=features,
        class_names=names,
        num_mask_classes=None if num_mask is None else int(num_mask),
        **{k: targets.get(k) for k in _TARGETS},
    )


# ------------------------------------------------------------------------------------------
# the probes
# ------------------------------------------------------------------------------------------


def classification_inputs(data: ProbeData, feature: str = "pooled") -> np.ndarray:
    """The per-image vector a classification probe reads: ``pooled``, ``class_token``, or
    ``patch_mean`` (the mean patch token of the deepest layer available)."""
    if feature == "patch_mean":
        tokens = data.features.require("patch_tokens")
        return tokens[max(tokens)].mean(axis=1)
    if feature not in ("pooled", "class_token"):
        raise ValueError(f"feature must be pooled, class_token or patch_mean, got {feature!r}")
    x = data.features.require(feature)
    if x.ndim != 2:
        raise DataError(f"{feature} features must be one vector per image ([N, D]), got shape "
                        f"{list(x.shape)}")
    return x


def _splits(labels: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    train, val, test = split_indices(labels, (0.6, 0.2, 0.2), seed)
    if not len(test):
        raise ValueError(
            f"{len(labels)} labelled images are too few to test on: the probes hold out 20% of "
            "each class (rounded), which leaves a test image only in a class of 3 or more")
    return train, val, test


def run_classification(
    kind: str, data: ProbeData, seed: int = 0, feature: str = "pooled", **options
) -> dict:
    """linear / fewshot / knn on a stratified 80 / 20 split (linear picks C inside the 80)."""
    labels = two_classes(data.require("labels", f"{kind} probe"), f"{kind} probe")
    x = classification_inputs(data, feature)
    train, val, test = _splits(labels, seed)
    pool = np.sort(np.concatenate([train, val]))
    fn = {"linear": linear.linear_probe, "fewshot": fewshot.fewshot_probe, "knn": knn.knn_probe}
    report = fn[kind](
        x[pool], labels[pool], x[test], labels[test], class_names=data.class_names, **options
    )
    return {**report, "feature": feature, "test_rows_seen_in_training": _seen(x, pool, test)}


def _seen(x: np.ndarray, train: np.ndarray, test: np.ndarray) -> int:
    """Test rows identical to a training row (an image twice in the data, once on each side of
    the split: scored as seen, a kNN finds it at distance 0); warned when there are any."""
    rows = np.ascontiguousarray(x).view(np.dtype((np.void, x.dtype.itemsize * x.shape[1])))
    seen = int(np.isin(rows[test].ravel(), rows[train].ravel()).sum())
    if seen:
        log.warning("%d of %d test images have features identical to a training image's "
                    "(duplicates in the data): the scores count them as seen", seen, len(test))
    return seen


def _head_logits(data: ProbeData, head: LinearHead | None) -> np.ndarray | None:
    if head is not None:
        return head.logits(data.features.require("pooled"))
    return data.features.logits


def run_calibration(
    data: ProbeData,
    seed: int = 0,
    feature: str = "pooled",
    head: LinearHead | None = None,
    bins: int = calibration.DEFAULT_BINS,
) -> dict:
    """Logits from an imported head (or the model's classifier) when given, else from a logistic
    regression fitted on a training split; temperature fitted on validation; report on test."""
    labels = data.require("labels", "calibration probe")
    train, val, test = _splits(labels, seed)
    if not len(val):
        raise DataError(
            f"{len(labels)} labelled images are too few to calibrate: the probe holds out 20% "
            "of each class (rounded) to fit the temperature and 20% to test on, which leaves "
            "a validation image only in a class of 4 or more")
    logits = _head_logits(data, head)
    source = "imported head" if head is not None else "model classifier"
    if head is not None:
        labels = _as_head_classes(labels, data.class_names, head)
    if logits is None:
        two_classes(labels, "calibration probe (a logistic regression on the features)")
        x = classification_inputs(data, feature)
        best_c, _ = linear.select_c(x[train], labels[train], x[val], labels[val])
        model = linear.fit_logistic(x[train], labels[train], best_c)
        # Over the classes it was trained on (every class present: the split is stratified);
        # a column for a class index no image has would be -inf, which no calibration metric takes.
        logits = linear.class_scores(model, x, int(labels.max()) + 1)[:, model.classes_]
        labels = np.searchsorted(model.classes_, labels)
        source = f"logistic regression on {feature} features (C={best_c:g})"
    report = calibration.calibration_probe(
        logits[val], labels[val], logits[test], labels[test], bins
    )
    return {**report, "logits_from": source}


def _as_head_classes(labels: np.ndarray, names: tuple[str, ...], head: LinearHead) -> np.ndarray:
    """The images' labels as the head's class indices: matched by name where both name their
    classes (a folder "cat" is not the head's class 0 because it sorts first), else as given."""
    if not names or not head.class_names:
        return labels
    column = {name: i for i, name in enumerate(head.class_names)}
    missing = [names[c] for c in np.unique(labels) if names[c] not in column]
    if missing:
        nfc = {unicodedata.normalize("NFC", name) for name in head.class_names}
        other_form = any(unicodedata.normalize("NFC", name) in nfc for name in missing)
        raise DataError(f"the head has no class named {', '.join(map(repr, missing[:5]))} "
                        f"(its {len(column)} classes: {', '.join(head.class_names[:5])}, ...)"
                        + ("; a name matches one of the head's in another Unicode form (NFC "
                           "and NFD spell accents apart)" if other_form else ""))
    return np.asarray([column[name] for name in names])[labels]


def _dense_split(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    train, test = split_indices(np.zeros(n, int), (0.75, 0.25), seed)
    if not len(train) or not len(test):
        raise DataError(f"{n} images are too few: the dense probes train on three quarters of "
                        "them and test on the rest (rounded), so they need 3 images or more")
    return train, test


def _default_layers(features: Features, layers) -> tuple[int, ...]:
    available = sorted(features.require("patch_tokens"))
    layers = tuple(layers) if layers else tuple(available)
    missing = [layer for layer in layers if layer not in available]
    if missing:
        raise DataError(f"no patch tokens of layers {missing}; available: {available}")
    return layers


def run_depth(data: ProbeData, seed: int = 0, layers=(), out_dir=None, **options) -> dict:
    depth = data.require("depth", "depth probe")
    train, test = _dense_split(len(depth), seed)
    layers = _default_layers(data.features, layers)
    from . import dense  # jax, flax and optax: only for the decoders that train

    report, predictions = dense.depth_probe(
        data.features, depth, train, test, layers,
        use_pooled=data.features.pooled is not None, seed=seed, **options,
    )  # fmt: skip
    if out_dir is not None:
        images = None if data.images is None else data.images[test]
        report["figure"] = str(
            plots.depth_figure(images, depth[test], predictions, Path(out_dir) / "depth.png")
        )
    return report


def run_segmentation(data: ProbeData, seed: int = 0, layers=(), out_dir=None,
                     ignore_index: int | None = IGNORE_INDEX, **options) -> dict:
    mask = data.require("mask", "segmentation probe")
    labelled = mask if ignore_index is None else mask[mask != ignore_index]
    num_classes = data.num_mask_classes or int(labelled.max(initial=0)) + 1
    train, test = _dense_split(len(mask), seed)
    layers = _default_layers(data.features, layers)
    from . import dense

    report, pred = dense.segmentation_probe(data.features, mask, num_classes, train, test,
                                            layers, seed=seed, ignore_index=ignore_index,
                                            **options)
    if out_dir is not None:
        images = None if data.images is None else data.images[test]
        report["figure"] = str(plots.segmentation_figure(
            images, mask[test], pred, Path(out_dir) / "segmentation.png", ignore_index
        ))  # fmt: skip
    return report


def run_shape_bias(
    conflict: ProbeData,
    train: ProbeData | None = None,
    head: LinearHead | None = None,
    feature: str = "pooled",
    seed: int = 0,
    out_dir=None,
) -> dict:
    """Decisions on cue-conflict images from: an imported head or the model's classifier
    (1000-way ImageNet -> 16 categories, or one logit per category), or else a logistic
    regression trained on ``train`` (images whose shape and texture agree)."""
    shapes = conflict.require("labels", "shape-bias probe")
    textures = conflict.require("texture", "shape-bias probe")
    names = conflict.class_names
    logits = _head_logits(conflict, head)
    if logits is not None:
        if logits.shape[1] == 1000 and len(names) == len(shape_bias.CATEGORIES):
            if names != shape_bias.CATEGORIES:
                raise DataError(
                    f"1000-way ImageNet decisions map to {shape_bias.CATEGORIES}, "
                    f"but the stimuli's categories are {names}"
                )
            scores = shape_bias.imagenet_to_categories(np.exp(log_softmax(logits)))
            source = "1000-way ImageNet head mapped to 16 categories (mean probability)"
        elif logits.shape[1] == len(names):
            scores, source = logits, f"{len(names)}-way head"
            if head is not None and head.class_names and head.class_names != names:
                order = _as_head_classes(np.arange(len(names)), names, head)  # by name
                scores = logits[:, order]
                source += " (its classes matched to the categories by name)"
        else:
            raise DataError(
                f"a head with {logits.shape[1]} classes cannot decide between the "
                f"{len(names)} categories {names}"
            )
    elif train is not None:
        labels = train.require("labels", "shape-bias head training")
        x = classification_inputs(train, feature)
        fit, val = split_indices(labels, (0.8, 0.2), seed)
        best_c, _ = linear.select_c(x[fit], labels[fit], x[val], labels[val])
        model = linear.fit_logistic(x, labels, best_c)
        scores = linear.class_scores(model, classification_inputs(conflict, feature), len(names))
        source = f"logistic regression (C={best_c:g}) trained on {len(labels)} cue-agreeing images"
    else:
        raise DataError(
            "shape bias needs decisions: an imported head (--head), a model with a "
            "classifier, or cue-agreeing training images"
        )
    report = {
        "probe": "shape-bias",
        "decisions_from": source,
        "num_images": len(shapes),
        "num_classes": len(names),
        "chance_cue_decision_rate": 2 / len(names),
        **shape_bias.shape_bias(scores.argmax(axis=1), shapes, textures, names),
    }
    if out_dir is not None:
        report["figure"] = str(plots.shape_bias_figure(report, Path(out_dir) / "shape_bias.png"))
    return report


def run_diagnostics(data: ProbeData, out_dir=None) -> dict:
    features = data.features
    report = diagnostics.attention_diagnostics(
        features.require("attention_entropy"),
        features.require("attention_max_logit"),
        num_tokens=features.meta.get("num_tokens"),
    )
    if out_dir is not None:
        report["figure"] = str(plots.attention_heatmaps(report, Path(out_dir) / "attention.png"))
    return report


def run_probe(kind: str, data: ProbeData, out_dir=None, seed: int = 0, **options) -> dict:
    """Run one probe; with ``out_dir``, write ``<kind>.json`` (and its PNG) there.

    ``video`` takes a ``video.VideoFeatures`` (per-frame features of videos) as ``data``."""
    if kind == "video":
        from . import video  # jax, flax and optax, as dense's: only the probes that train

        report = video.run_video(data, seed=seed, **options)
        if out_dir is not None:
            report["report"] = str(write_report(report, out_dir, kind))
        return report
    if kind in ("linear", "fewshot", "knn"):
        report = run_classification(kind, data, seed=seed, **options)
    elif kind == "calibration":
        report = run_calibration(data, seed=seed, **options)
    elif kind == "depth":
        report = run_depth(data, seed=seed, out_dir=out_dir, **options)
    elif kind == "segmentation":
        report = run_segmentation(data, seed=seed, out_dir=out_dir, **options)
    elif kind == "shape-bias":
        report = run_shape_bias(data, seed=seed, out_dir=out_dir, **options)
    elif kind == "diagnostics":
        report = run_diagnostics(data, out_dir=out_dir)
    else:
        raise ValueError(f"unknown probe {kind!r}; choose from {KINDS}")
    report = {**report, "features": dict(data.features.meta), "num_images": len(data.features)}
    if kind == "calibration" and out_dir is not None:
        report["figure"] = str(plots.reliability_diagram(report, Path(out_dir) / "reliability.png"))
    if out_dir is not None:
        report["report"] = str(write_report(report, out_dir, kind))
    return report
