"""Calibration: ECE, adaptive ECE, MCE, NLL, Brier, and temperature scaling.

Conventions (the tests check them by hand):
- Confidence is the top softmax probability; a prediction is correct when its arg-max is the label.
  ``ece``, ``adaptive_ece`` and ``mce`` take per-sample confidences in [0, 1] and correctness
  (``confidence_and_correct`` derives both from probabilities); ``calibration_metrics`` and
  ``calibration_probe`` take logits and labels.
- ECE uses ``bins`` equal-width bins: bin ``i`` holds confidences in ``[i/bins, (i+1)/bins)``, the
  last bin is closed, so a confidence of exactly 1.0 falls in the last bin and 0.0 in the first.
  ECE = sum over bins of (bin size / N) * |accuracy(bin) - mean confidence(bin)|.
- MCE is the largest |accuracy - mean confidence| over the non-empty equal-width bins.
- Adaptive ECE uses equal-mass bins: samples sorted by confidence (stable) and cut into ``bins``
  consecutive groups whose sizes differ by at most one (``numpy.array_split``); same formula.
- NLL is the mean of -log p(label), from the logits' log-softmax (probabilities would clip a
  confident wrong answer at -log of the smallest double); Brier is the mean over samples of
  sum_c (p_c - onehot_c)^2.
- Temperature scaling divides logits by T > 0 fitted to minimise NLL on a validation split;
  the arg-max, hence accuracy, does not change. NLL(softmax(b * logits)) is convex in b = 1/T
  (its second derivative is the mean variance of the logits under the softmax), so the fit is
  the root of its derivative, found without bounds on T. Where the minimum lies at a limit (a
  validation split the logits classify all right: T -> 0; logits no better than uniform: T ->
  infinity; constant logits) there is no temperature to apply: the report's ``temperature`` is
  null, ``temperature_limit`` says why, and "after" is "before".
"""

from __future__ import annotations

import numpy as np

from .metrics import checked_set, log_softmax, softmax

DEFAULT_BINS = 15


def confidence_and_correct(probs: np.ndarray, labels: np.ndarray):
    """Top probability of each row, and 1.0 where its arg-max is the label (else 0.0)."""
    probs = np.asarray(probs, np.float64)
    return probs.max(axis=1), (probs.argmax(axis=1) == np.asarray(labels)).astype(np.float64)


def equal_width_bins(confidence: np.ndarray, bins: int) -> list[np.ndarray]:
    index = np.clip(np.floor(np.asarray(confidence) * bins).astype(int), 0, bins - 1)
    return [np.flatnonzero(index == b) for b in range(bins)]


def equal_mass_bins(confidence: np.ndarray, bins: int) -> list[np.ndarray]:
    return np.array_split(np.argsort(confidence, kind="stable"), bins)


def _checked(confidence, correct, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Confidences in [0, 1], one per prediction, and a positive number of bins."""
    confidence, correct = np.asarray(confidence, np.float64), np.asarray(correct, np.float64)
    if isinstance(bins, bool) or int(bins) != bins or bins < 1:
        raise ValueError(f"bins must be a positive integer, got {bins!r}")
    if confidence.shape != correct.shape or confidence.size == 0:
        raise ValueError(f"need one confidence per prediction, got {confidence.shape} "
                         f"confidences for {correct.shape} outcomes")
    if not np.all((confidence >= 0) & (confidence <= 1)):  # NaN fails this too
        raise ValueError("confidences must be probabilities in [0, 1] (none NaN)")
    return confidence, correct


def _gaps(confidence, correct, groups) -> list[tuple[int, float]]:
    """Per non-empty group: (size, |accuracy - mean confidence|)."""
    return [(len(g), abs(correct[g].mean() - confidence[g].mean())) for g in groups if len(g)]


def _weighted(gaps: list[tuple[int, float]]) -> float:
    total = sum(size for size, _ in gaps)
    return float(sum(size * gap for size, gap in gaps) / total)


def ece(confidence, correct, bins: int = DEFAULT_BINS) -> float:
    """Expected calibration error over equal-width bins (confidence 1.0 in the last bin)."""
    confidence, correct = _checked(confidence, correct, bins)
    return _weighted(_gaps(confidence, correct, equal_width_bins(confidence, bins)))


def adaptive_ece(confidence, correct, bins: int = DEFAULT_BINS) -> float:
    """Expected calibration error over equal-mass bins."""
    confidence, correct = _checked(confidence, correct, bins)
    return _weighted(_gaps(confidence, correct, equal_mass_bins(confidence, bins)))


def mce(confidence, correct, bins: int = DEFAULT_BINS) -> float:
    """Maximum calibration error: the largest gap of a non-empty equal-width bin."""
    confidence, correct = _checked(confidence, correct, bins)
    return float(
        max(gap for _, gap in _gaps(confidence, correct, equal_width_bins(confidence, bins)))
    )


def nll(log_probs: np.ndarray, labels: np.ndarray) -> float:
    return float(-np.mean(np.asarray(log_probs, np.float64)[np.arange(len(labels)), labels]))


def brier(probs: np.ndarray, labels: np.ndarray) -> float:
    probs = np.asarray(probs, np.float64)  # sum_c (p_c - [c = y])^2, with no one-hot [N, C]
    own = probs[np.arange(len(labels)), labels]
    return float(np.mean(np.sum(probs**2, axis=1) - 2.0 * own + 1.0))


def reliability_table(probs: np.ndarray, labels: np.ndarray, bins: int = DEFAULT_BINS) -> list:
    """Per equal-width bin: its range, count, accuracy and mean confidence (None when empty)."""
    confidence, correct = confidence_and_correct(probs, labels)
    rows = []
    for b, group in enumerate(equal_width_bins(confidence, bins)):
        rows.append(
            {
                "low": b / bins,
                "high": (b + 1) / bins,
                "count": len(group),
                "accuracy": float(correct[group].mean()) if len(group) else None,
                "confidence": float(confidence[group].mean()) if len(group) else None,
            }
        )
    return rows


def calibration_metrics(logits: np.ndarray, labels: np.ndarray, bins: int = DEFAULT_BINS) -> dict:
    log_probs = log_softmax(logits)
    probs = np.exp(log_probs)
    confidence, correct = confidence_and_correct(probs, labels)
    return {
        "accuracy": float(correct.mean()),
        "mean_confidence": float(confidence.mean()),
        "ece": ece(confidence, correct, bins),
        "adaptive_ece": adaptive_ece(confidence, correct, bins),
        "mce": mce(confidence, correct, bins),
        "nll": nll(log_probs, labels),
        "brier": brier(probs, labels),
    }


# How far the fit follows b = 1/T up from the logits' own scale before it calls the minimum a
# limit (T -> 0): 2^40, about 1e12.
_DOUBLINGS = 40


def _nll_slope(logits: np.ndarray, gaps: np.ndarray, b: float) -> float:
    """d/db of the mean NLL of softmax(b * logits), ``gaps`` the logits less each row's label's:
    the mean of E_p[gaps] (as E_p[logit] - logit[label] it cancels to 0 once the other classes'
    p are below 1e-16)."""
    return float(np.mean((softmax(b * logits) * gaps).sum(axis=1)))


def fit_temperature(logits: np.ndarray, labels: np.ndarray) -> tuple[float | None, str | None]:
    """The T > 0 minimising NLL(softmax(logits / T)), and None; or, where no finite positive T
    does (the minimum lies at a limit), None and what the limit means."""
    from scipy.optimize import brentq

    logits = np.asarray(logits, np.float64)
    centred = logits - logits.mean(axis=1, keepdims=True)  # the softmax is the same
    spread = float(np.abs(centred).max())
    if not spread > 0:
        return None, "no fit: the logits are equal within each row (no temperature changes them)"
    scaled = centred / spread  # searched at scale 1: no overflow or underflow at any spread
    gaps = scaled - scaled[np.arange(len(labels)), labels][:, None]
    if _nll_slope(scaled, gaps, 0.0) >= 0:
        return None, ("T -> infinity: no temperature makes the validation NLL lower than "
                      "uniform probabilities do")
    low, high = 0.0, 1.0
    for _ in range(_DOUBLINGS):
        if _nll_slope(scaled, gaps, high) > 0:  # 0: every p underflowed to one-hot
            break
        low, high = high, 2 * high
    else:
        return None, ("T -> 0: the validation NLL falls with the temperature (every validation "
                      "label has the largest logit)")
    b = brentq(lambda v: _nll_slope(scaled, gaps, v), low, high, xtol=1e-14 * high,
               rtol=1e-12)
    return spread / b, None


def calibration_probe(
    val_logits: np.ndarray,
    val_labels: np.ndarray,
    test_logits: np.ndarray,
    test_labels: np.ndarray,
    bins: int = DEFAULT_BINS,
) -> dict:
    """Fit the temperature on the validation split; metrics on the test split before and after."""
    val_logits, val_labels = checked_set(val_logits, val_labels, "validation", "logits")
    test_logits, test_labels = checked_set(test_logits, test_labels, "test", "logits")
    classes = val_logits.shape[1]
    if test_logits.shape[1] != classes or max(val_labels.max(), test_labels.max()) >= classes:
        raise ValueError(f"logits of {classes} (validation) and {test_logits.shape[1]} (test) "
                         f"classes for labels up to {max(val_labels.max(), test_labels.max())}")
    temperature, limit = fit_temperature(val_logits, val_labels)
    before = np.asarray(test_logits, np.float64)
    after = before if temperature is None else before / temperature  # no finite T: none applied
    return {
        "probe": "calibration",
        "bins": bins,
        "temperature": temperature,
        "temperature_limit": limit,
        "num_val": len(val_labels),
        "num_test": len(test_labels),
        "before": calibration_metrics(before, test_labels, bins),
        "after": calibration_metrics(after, test_labels, bins),
        "reliability_before": reliability_table(softmax(before), test_labels, bins),
        "reliability_after": reliability_table(softmax(after), test_labels, bins),
    }
