"""Small numpy helpers every classification probe shares: input checks, softmax, top-k,
baselines, splits."""

from __future__ import annotations

import numpy as np

from .data import DataError

# Classes a probe accepts beyond one per image: the probes hold [N, C] scores, so C is bounded
# (ImageNet-21k's 21,843 classes fit; class indices must be dense, 0..C-1).
MAX_CLASSES = 65_536


def check_class_indices(name: str, value: np.ndarray, per_image: bool = True) -> None:
    """Integer class indices 0..C-1 with C at most ``MAX_CLASSES`` or the number of images (a
    label of 10^12 would ask a probe for 10^12 columns of scores); ``per_image``: one each
    ([N]), else maps ([N, H, W])."""
    if not np.issubdtype(value.dtype, np.integer):
        raise DataError(f"{name} must be integer class indices, got dtype {value.dtype} (map "
                        "names to 0..C-1 first)")
    if per_image and value.ndim != 1:
        raise DataError(f"{name} must be one class index per image, got shape "
                        f"{list(value.shape)}")
    if value.size and value.min() < 0:
        where = np.unravel_index(int(value.argmin()), value.shape)[0]
        raise DataError(f"{name}: class index {value.min()} (image {where}) is negative: "
                        "indices run 0..C-1")
    cap = max(MAX_CLASSES, len(value))
    if value.size and value.max() >= cap:
        where = np.unravel_index(int(value.argmax()), value.shape)[0]
        raise DataError(f"{name}: class index {value.max()} (image {where}) is too large: "
                        f"indices run 0..C-1 with C at most {cap:,} (the larger of "
                        f"{MAX_CLASSES:,} and the number of images); map them to 0..C-1 first")


def class_name_list(value: np.ndarray, what: str) -> tuple[str, ...]:
    """A file's class names: a 1-D array of distinct strings (two classes of one name would be
    merged where names are matched, as against a head's)."""
    if value.ndim != 1 or value.dtype.kind not in "US":
        raise DataError(f"{what} must be a 1-D array of strings, got {value.dtype} "
                        f"{list(value.shape)}")
    if value.dtype.kind == "S":  # bytes: UTF-8 text
        try:
            value = np.char.decode(value, "utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"{what}: bytes that are not UTF-8 text ({err.reason} at byte "
                            f"{err.start})") from None
    names = tuple(str(s) for s in value)
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in seen:
            raise DataError(f"{what}: class {i} and class {seen[name]} are both named "
                            f"{name!r}; each class needs its own name")
        seen[name] = i
    return names


def check_class_names(names: tuple[str, ...], labels: np.ndarray) -> None:
    most = int(np.max(labels)) + 1 if len(labels) else 0
    if names and len(names) < most:
        raise DataError(f"{len(names)} class names for labels up to {most - 1}: one name per "
                        "class index")


def two_classes(labels: np.ndarray, why: str) -> np.ndarray:
    """A classifier's labels: images of two classes at least (with one, every score is 1.0)."""
    classes = np.unique(labels)
    if len(classes) < 2:
        raise DataError(f"the {why} needs images of 2 classes or more; all {len(labels)} are "
                        f"of class {classes[0]}")
    return labels


def checked_set(x, y, name: str, rows: str = "features") -> tuple[np.ndarray, np.ndarray]:
    """One set of a probe's inputs, checked: real-valued, finite [N, D] features and N integer
    class indices >= 0 (integral floats are taken as integers). Returns (x, y as int64); a
    ValueError names the set and what is wrong, instead of a silent score or a deep error."""
    x, y = np.asarray(x), np.asarray(y)
    real = np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)
    if x.ndim != 2 or not real:
        raise ValueError(f"{name} {rows} must be a real [N, D] array, got {x.dtype} "
                         f"{list(x.shape)}")
    if y.ndim != 1 or len(y) != len(x):
        raise ValueError(f"{name} labels must be one per row of {rows}: {list(y.shape)} labels "
                         f"for {len(x)} rows")
    if not len(x):
        raise ValueError(f"the {name} set is empty")
    if np.issubdtype(y.dtype, np.floating) and np.all(np.isfinite(y)) and np.all(y == np.round(y)):
        y = y.astype(np.int64)
    if not np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_:
        raise ValueError(f"{name} labels must be integer class indices 0..C-1, got {y.dtype}")
    if y.min() < 0:
        raise ValueError(f"{name} labels must be class indices >= 0, got {y.min()}")
    bad = np.flatnonzero(~np.isfinite(x).all(axis=1))
    if len(bad):
        raise ValueError(f"{name} {rows}: {len(bad)} of {len(x)} rows hold NaN or Inf (the "
                         f"first: row {bad[0]})")
    return x, y.astype(np.int64)


def checked_sets(train_x, train_y, test_x, test_y) -> tuple[np.ndarray, ...]:
    """Both sets of a probe (``checked_set``), with features of one width."""
    train_x, train_y = checked_set(train_x, train_y, "training")
    test_x, test_y = checked_set(test_x, test_y, "test")
    if train_x.shape[1] != test_x.shape[1]:
        raise ValueError(f"training features have {train_x.shape[1]} dimensions, test features "
                         f"{test_x.shape[1]}")
    return train_x, train_y, test_x, test_y


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def softmax(logits: np.ndarray) -> np.ndarray:
    return np.exp(log_softmax(logits))


def topk_accuracy(scores: np.ndarray, labels: np.ndarray, k: int) -> float:
    """Fraction of rows whose label is among the ``k`` highest scores (ties: lower index first).
    A score of -inf is no answer: a label scored so is never a hit, even when fewer than ``k``
    classes score more (a kNN class no neighbour voted for)."""
    k = min(k, scores.shape[1])
    labels = np.asarray(labels)
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    answered = scores[np.arange(len(labels)), labels] > -np.inf
    return float(np.mean(np.any(top == labels[:, None], axis=1) & answered))


def classification_scores(scores: np.ndarray, labels: np.ndarray) -> dict:
    return {"top1": topk_accuracy(scores, labels, 1), "top5": topk_accuracy(scores, labels, 5)}


def trivial_baselines(train_labels: np.ndarray, test_labels: np.ndarray, num_classes: int) -> dict:
    """What a probe must beat: uniform guessing, and always answering the training majority."""
    majority = np.bincount(train_labels, minlength=num_classes).argmax()
    return {
        "chance_top1": 1.0 / num_classes,
        "majority_class": int(majority),
        "majority_top1": float(np.mean(test_labels == majority)),
    }


def split_indices(
    labels: np.ndarray, fractions: tuple[float, ...], seed: int = 0
) -> list[np.ndarray]:
    """Stratified random split of ``range(len(labels))`` into parts of the given fractions.

    Each class is shuffled and cut by the fractions separately, so every part keeps the class
    proportions; the last part takes the rounding remainder.
    """
    if abs(sum(fractions) - 1.0) > 1e-6 or min(fractions) <= 0:
        raise ValueError(f"split fractions must be positive and sum to 1, got {fractions}")
    rng = np.random.default_rng(seed)
    parts: list[list[np.ndarray]] = [[] for _ in fractions]
    bounds = np.cumsum(fractions)[:-1]
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        cuts = np.round(bounds * len(members)).astype(int)
        for part, chunk in zip(parts, np.split(members, cuts)):
            part.append(chunk)
    return [np.sort(np.concatenate(p)) for p in parts]


def num_classes_of(*label_arrays: np.ndarray, names: tuple[str, ...] = ()) -> int:
    return max(len(names), *(int(np.max(a)) + 1 for a in label_arrays if len(a)))
