"""Few-shot probe: closed-form ridge regression on whitened features (big_vision's fewshot_lsr).

Per seed, draw ``shots`` training images of every class; whiten with their per-dimension mean and
standard deviation; append a large constant feature so the bias is almost unregularised; regress
one-hot targets in {-1, +1} with an L2 penalty; predict the arg-max. The ridge solve goes through
one eigendecomposition of the smaller Gram matrix (``x^T x`` or ``x x^T``), so it is cheap for
any number of shots. Reports the mean and spread over seeds.
"""

from __future__ import annotations

import numpy as np

from .metrics import checked_sets, num_classes_of, trivial_baselines

DEFAULT_SHOTS = (1, 5, 10, 25)
DEFAULT_L2 = 2.0**10  # big_vision's usual l2_reg for few-shot linear evaluation
BIAS_FEATURE = 100.0


def ridge_classifier(x: np.ndarray, y: np.ndarray, num_classes: int, l2: float):
    """Fit on (x, y); returns ``predict(x_test) -> scores [N, num_classes]``."""
    x = np.asarray(x, np.float64)
    mean, std = x.mean(axis=0), x.std(axis=0) + 1e-5

    def design(v: np.ndarray) -> np.ndarray:
        v = (np.asarray(v, np.float64) - mean) / std
        return np.pad(v, ((0, 0), (0, 1)), constant_values=BIAS_FEATURE)

    a = design(x)
    targets = np.full((len(y), num_classes), -1.0)  # +1 at each row's class, -1 elsewhere
    targets[np.arange(len(y)), y] = 1.0
    n, d = a.shape
    # (a^T a + l2 I)^-1 a^T t  ==  a^T (a a^T + l2 I)^-1 t ; eigendecompose the smaller Gram.
    if n >= d:
        eigs, q = np.linalg.eigh(a.T @ a)
        w = (q / (eigs + l2)) @ (q.T @ (a.T @ targets))
    else:
        eigs, q = np.linalg.eigh(a @ a.T)
        w = a.T @ ((q / (eigs + l2)) @ (q.T @ targets))
    return lambda v: design(v) @ w


def fewshot_probe(
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray,
    test_y: np.ndarray,
    shots: tuple[int, ...] = DEFAULT_SHOTS,
    seeds: tuple[int, ...] = (0, 1, 2),
    l2: float = DEFAULT_L2,
    class_names: tuple[str, ...] = (),
) -> dict:
    """Top-1 of the ridge classifier for each number of shots: mean, std and per-seed values."""
    train_x, train_y, test_x, test_y = checked_sets(train_x, train_y, test_x, test_y)
    num_classes = num_classes_of(train_y, test_y, names=class_names)
    present = np.unique(train_y)  # shots of the classes there are (an index may have none)
    fewest = int(np.bincount(train_y)[present].min())
    results, skipped = {}, {}
    for k in shots:
        if fewest < k:
            skipped[str(k)] = f"a class has only {fewest} training images (< {k} shots)"
            continue
        accuracies = []
        for seed in seeds:
            rng = np.random.default_rng(seed)
            picked = np.concatenate(
                [rng.permutation(np.flatnonzero(train_y == c))[:k] for c in present]
            )
            predict = ridge_classifier(train_x[picked], train_y[picked], num_classes, l2)
            accuracies.append(float(np.mean(predict(test_x).argmax(axis=1) == test_y)))
        results[str(k)] = {
            "top1_mean": float(np.mean(accuracies)),
            "top1_std": float(np.std(accuracies)),
            "top1_per_seed": accuracies,
        }
    if not results:  # a report of nothing measured is not a result
        raise ValueError(f"no number of shots in {list(shots)} fits: the smallest class has "
                         f"{fewest} training images")
    return {
        "probe": "fewshot",
        "l2": l2,
        "seeds": list(seeds),
        "num_test": len(test_y),
        "num_classes": num_classes,
        "shots": results,
        "skipped": skipped,
        "baselines": trivial_baselines(train_y, test_y, num_classes),
    }
