"""Linear probe: multinomial logistic regression with C picked on a validation split, then refit.

As in DINOv2's ``eval/log_regression.py``: sweep the inverse regularisation C on a held-out part
of the training data, refit on all of it with the best C, report top-1 / top-5 on the test set.
Features are standardised with training statistics (random-init and imported backbones differ
wildly in feature scale; lbfgs converges far better on standardised inputs).
"""

from __future__ import annotations

import warnings

import numpy as np

from .metrics import (
    checked_sets,
    classification_scores,
    num_classes_of,
    split_indices,
    trivial_baselines,
)

DEFAULT_CS = tuple(float(c) for c in np.logspace(-3, 2, 6))


def fit_logistic(x: np.ndarray, y: np.ndarray, c: float, max_iter: int = 500):
    """A standardise + logistic-regression pipeline fitted on (x, y)."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from threadpoolctl import threadpool_limits

    model = make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=max_iter))
    # Probe-sized problems: BLAS threads only add synchronisation (10x slower on 2 busy cores).
    with warnings.catch_warnings(), threadpool_limits(1, user_api="blas"):
        warnings.simplefilter("ignore", ConvergenceWarning)  # max_iter bounds a C sweep's cost
        return model.fit(x, y)


def class_scores(model, x: np.ndarray, num_classes: int) -> np.ndarray:
    """Logits [N, num_classes] (classes never seen in training get -inf)."""
    scores = model.decision_function(x)
    if scores.ndim == 1:  # two classes: sklearn returns the logit of the second
        scores = np.stack([np.zeros_like(scores), scores], axis=1)
    out = np.full((len(x), num_classes), -np.inf)
    out[:, model.classes_] = scores
    return out


def select_c(
    train_x: np.ndarray,
    train_y: np.ndarray,
    val_x: np.ndarray,
    val_y: np.ndarray,
    cs: tuple[float, ...] = DEFAULT_CS,
    max_iter: int = 500,
) -> tuple[float, dict[float, float]]:
    """The C with the best validation top-1 (ties: the stronger regularisation) and the sweep."""
    num_classes = num_classes_of(train_y, val_y)
    sweep = {}
    for c in cs:
        model = fit_logistic(train_x, train_y, c, max_iter)
        sweep[c] = classification_scores(class_scores(model, val_x, num_classes), val_y)["top1"]
    return max(sweep, key=lambda c: (sweep[c], -c)), sweep


def linear_probe(
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray,
    test_y: np.ndarray,
    cs: tuple[float, ...] = DEFAULT_CS,
    val_fraction: float = 0.2,
    seed: int = 0,
    max_iter: int = 500,
    class_names: tuple[str, ...] = (),
) -> dict:
    """Sweep C on a stratified validation split of the training set, refit, score the test set."""
    train_x, train_y, test_x, test_y = checked_sets(train_x, train_y, test_x, test_y)
    num_classes = num_classes_of(train_y, test_y, names=class_names)
    fit_idx, val_idx = split_indices(train_y, (1 - val_fraction, val_fraction), seed)
    if len(np.unique(train_y[fit_idx])) < 2 or not len(val_idx):
        counts = np.bincount(train_y)
        raise ValueError(
            f"the linear probe fits on {1 - val_fraction:g} of each class's training images and "
            f"sweeps C on the rest: that needs 2 classes or more with images on both sides (the "
            f"training set has {np.count_nonzero(counts)} classes, the largest "
            f"{counts.max()} images)")
    best_c, sweep = select_c(
        train_x[fit_idx], train_y[fit_idx], train_x[val_idx], train_y[val_idx], cs, max_iter
    )
    model = fit_logistic(train_x, train_y, best_c, max_iter)
    test = classification_scores(class_scores(model, test_x, num_classes), test_y)
    return {
        "probe": "linear",
        "num_train": len(train_y),
        "num_test": len(test_y),
        "num_classes": num_classes,
        "best_C": best_c,
        "val_top1_by_C": {f"{c:g}": v for c, v in sweep.items()},
        **test,
        "baselines": trivial_baselines(train_y, test_y, num_classes),
    }
