"""Shape bias on cue-conflict stimuli (Geirhos et al. 2019; model-vs-human).

A decision on a cue-conflict image (shape of one category, texture of another) counts as a
*shape* decision when it names the shape category, a *texture* decision when it names the
texture category, and neither otherwise. Shape bias = shape / (shape + texture) decisions.
Images whose shape and texture category are the same are not cue-conflict trials: left out.

Decisions over the 16 categories come from a 16-way head directly, or from 1000-way ImageNet
probabilities: each category scores the mean probability of its ImageNet classes (the indices
model-vs-human uses, listed below), and the highest-scoring category is the decision.
"""

from __future__ import annotations

import numpy as np

# The 16 entry-level categories, sorted (the order of model-vs-human and of the stimuli folders).
CATEGORIES = (
    "airplane", "bear", "bicycle", "bird", "boat", "bottle", "car", "cat",
    "chair", "clock", "dog", "elephant", "keyboard", "knife", "oven", "truck",
)  # fmt: skip

# ILSVRC-2012 class indices of each category, as in model-vs-human's helper/human_categories.py.
IMAGENET_INDICES: dict[str, tuple[int, ...]] = {
    "airplane": (404,),
    "bear": (294, 295, 296, 297),
    "bicycle": (444, 671),
    "bird": (
        8, 10, 11, 12, 13, 14, 15, 16, 18, 19, 20, 22, 23, 24, 80, 81, 82, 83, 87, 88, 89, 90, 91,
        92, 93, 94, 95, 96, 98, 99, 100, 127, 128, 129, 130, 131, 132, 133, 135, 136, 137, 138,
        139, 140, 141, 142, 143, 144, 145,
    ),
    "boat": (472, 554, 625, 814, 914),
    "bottle": (440, 720, 737, 898, 899, 901, 907),
    "car": (436, 511, 817),
    "cat": (281, 282, 283, 284, 285, 286),
    "chair": (423, 559, 765, 857),
    "clock": (409, 530, 892),
    "dog": (
        *range(152, 192), *range(193, 204), *range(205, 227), *range(228, 242), *range(243, 251),
        *range(252, 258), 259, *range(261, 264), *range(265, 269),
    ),
    "elephant": (385, 386),
    "keyboard": (508, 878),
    "knife": (499,),
    "oven": (766,),
    "truck": (555, 569, 656, 675, 717, 734, 864, 867),
}  # fmt: skip


def imagenet_to_categories(probs: np.ndarray) -> np.ndarray:
    """ImageNet probabilities [N, 1000] -> category scores [N, 16] (mean over each category)."""
    probs = np.asarray(probs, np.float64)
    if probs.ndim != 2 or probs.shape[1] != 1000:
        raise ValueError(f"expected ImageNet probabilities [N, 1000], got shape {probs.shape}")
    return np.stack([probs[:, IMAGENET_INDICES[c]].mean(axis=1) for c in CATEGORIES], axis=1)


def shape_bias(
    decisions: np.ndarray,
    shape_labels: np.ndarray,
    texture_labels: np.ndarray,
    class_names: tuple[str, ...] = CATEGORIES,
) -> dict:
    """Shape bias of category decisions on cue-conflict images, overall and per shape category."""
    decisions, shapes, textures = (np.asarray(a) for a in (decisions, shape_labels, texture_labels))
    if not decisions.shape == shapes.shape == textures.shape:
        raise ValueError("decisions, shape and texture labels must have the same length")
    conflict = shapes != textures
    shape_hit = conflict & (decisions == shapes)
    texture_hit = conflict & (decisions == textures)

    def summary(select: np.ndarray) -> dict:
        n_shape, n_texture = int(shape_hit[select].sum()), int(texture_hit[select].sum())
        n_conflict = int(conflict[select].sum())
        return {
            "shape_bias": n_shape / (n_shape + n_texture) if n_shape + n_texture else None,
            "shape_decisions": n_shape,
            "texture_decisions": n_texture,
            "other_decisions": n_conflict - n_shape - n_texture,
            "conflict_images": n_conflict,
            "same_category_excluded": int((select & ~conflict).sum()),
        }

    everything = np.ones(len(decisions), bool)
    return {
        **summary(everything),
        # Of the cue-conflict images, the share decided by either cue (chance: 2 / classes).
        "cue_decision_rate": float((shape_hit | texture_hit).sum() / max(conflict.sum(), 1)),
        "per_category": {
            name: summary(shapes == i) for i, name in enumerate(class_names) if (shapes == i).any()
        },
    }
