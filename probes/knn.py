"""k-nearest-neighbour probe: cosine similarity, temperature-weighted votes (DINOv2 eval/knn.py).

Each test feature votes with its k most similar training features; a neighbour with cosine
similarity s adds ``exp(s / T)`` to its class. Top-1 / top-5 of the summed votes; a class none
of the k neighbours belongs to is no answer (with k = 1 top-5 is top-1, as in DINOv2's eval,
which counts min(5, k) answers).
"""

from __future__ import annotations

import numpy as np

from .metrics import checked_sets, classification_scores, num_classes_of, trivial_baselines

DEFAULT_KS = (10, 20, 100, 200)
DEFAULT_TEMPERATURE = 0.07


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    # each row over its largest magnitude first: a norm of values over ~1e19 overflows in
    # float32, and a float64 copy would double a large bank's memory
    x = x / np.maximum(np.abs(x).max(axis=1, keepdims=True), np.finfo(np.float32).tiny)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def knn_votes(
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray,
    ks: tuple[int, ...],
    num_classes: int,
    temperature: float = DEFAULT_TEMPERATURE,
    chunk: int = 1024,
) -> dict[int, np.ndarray]:
    """Class votes [N_test, num_classes] for each k (k is capped at the training set's size),
    each row scaled by exp(-s_nearest / T): the classes' order is that of ``exp(s / T)``, and at
    small temperatures no weight overflows (exp(1 / 0.001) is infinite in float64, which tied
    every class it reached). A class none of the k neighbours belongs to votes -inf: no
    answer."""
    bank, queries = _unit(train_x), _unit(test_x)
    kmax = min(max(ks), len(bank))
    votes = {k: np.zeros((len(queries), num_classes)) for k in ks}
    for start in range(0, len(queries), chunk):
        sim = queries[start : start + chunk] @ bank.T
        top = np.argpartition(-sim, kmax - 1, axis=1)[:, :kmax]
        top_sim = np.take_along_axis(sim, top, axis=1)
        order = np.argsort(-top_sim, axis=1, kind="stable")
        top, top_sim = np.take_along_axis(top, order, 1), np.take_along_axis(top_sim, order, 1)
        top_sim = top_sim.astype(np.float64)
        weights = np.exp((top_sim - top_sim[:, :1]) / temperature)
        rows = np.arange(len(top))[:, None]
        for k in ks:  # each neighbour's weight added to its class: [n, C], never [n, kmax, C]
            kk = min(k, kmax)
            neighbours = train_y[top[:, :kk]]
            summed = np.zeros((len(top), num_classes))
            np.add.at(summed, (np.broadcast_to(rows, neighbours.shape), neighbours),
                      weights[:, :kk])
            members = np.zeros((len(top), num_classes), bool)
            members[np.broadcast_to(rows, neighbours.shape), neighbours] = True
            votes[k][start : start + chunk] = np.where(members, summed, -np.inf)
    return votes


def knn_probe(
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray,
    test_y: np.ndarray,
    ks: tuple[int, ...] = DEFAULT_KS,
    temperature: float = DEFAULT_TEMPERATURE,
    class_names: tuple[str, ...] = (),
) -> dict:
    train_x, train_y, test_x, test_y = checked_sets(train_x, train_y, test_x, test_y)
    num_classes = num_classes_of(train_y, test_y, names=class_names)
    votes = knn_votes(train_x, train_y, test_x, ks, num_classes, temperature)
    return {
        "probe": "knn",
        "temperature": temperature,
        "num_train": len(train_y),
        "num_test": len(test_y),
        "num_classes": num_classes,
        "by_k": {
            str(k): {"k_used": min(k, len(train_y)), **classification_scores(v, test_y)}
            for k, v in votes.items()
        },
        "baselines": trivial_baselines(train_y, test_y, num_classes),
    }
