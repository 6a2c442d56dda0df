"""The video probe: heads over frozen per-frame features [N, K, d] of K sampled frames.

- ``middle_frame``: the single-frame baseline, a linear head (logistic regression, C swept as in
  ``linear.py``) on the middle sampled frame's features (for odd K, the frame shown at D/2);
- ``temporal_mean``: the same linear head on the mean over frames (temporal average pooling,
  which cannot see the order of the frames);
- ``attention``: a small attention-pooling head trained with optax: frame features projected to
  ``dim``, plus a learned embedding of the frame's index (so the head can tell early from late),
  ``heads`` learned queries attending over the K frames, the pooled heads through a LayerNorm
  and a linear classifier. Adam(W), cosine decay, full-batch steps.

Every head reads standardised features (training statistics) and is scored on the same
stratified test split, top-1 against chance and the majority class.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import linear
from .data import DataError
from .features import check_finite, real_array, standardised
from .metrics import (
    check_class_indices,
    check_class_names,
    classification_scores,
    num_classes_of,
    split_indices,
    trivial_baselines,
    two_classes,
)


class AttentionPool(nn.Module):
    """Learned queries over frames (with a frame-index embedding), then a linear classifier."""

    num_classes: int
    frames: int
    dim: int = 64
    heads: int = 4

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # x: [B, K, d]
        head_dim = self.dim // self.heads
        h = nn.Dense(self.dim, name="project")(x)
        h = h + self.param("time", nn.initializers.normal(0.02), (self.frames, self.dim))
        keys = nn.DenseGeneral((self.heads, head_dim), name="key")(h)  # [B, K, H, hd]
        values = nn.DenseGeneral((self.heads, head_dim), name="value")(h)
        query = self.param("query", nn.initializers.normal(1.0), (self.heads, head_dim))
        weights = jax.nn.softmax(
            jnp.einsum("bkhd,hd->bhk", keys, query) / np.sqrt(head_dim), axis=-1
        )
        pooled = jnp.einsum("bhk,bkhd->bhd", weights, values).reshape(x.shape[0], self.dim)
        return nn.Dense(self.num_classes, name="classify")(nn.LayerNorm()(pooled))


@dataclass(frozen=True)
class AttentionConfig:
    dim: int = 32
    heads: int = 2
    steps: int = 400
    learning_rate: float = 3e-3
    weight_decay: float = 1e-2


def train_attention(
    x: np.ndarray, y: np.ndarray, num_classes: int, config: AttentionConfig, seed: int = 0
):
    """Fit ``AttentionPool`` on standardised [N, K, d] features -> (module, params, losses)."""
    module = AttentionPool(num_classes, x.shape[1], config.dim, config.heads)
    params = jax.jit(module.init)(jax.random.PRNGKey(seed), x[:1])  # jitted: one compile
    optimizer = optax.adamw(
        optax.cosine_decay_schedule(config.learning_rate, config.steps), config.weight_decay
    )
    state = optimizer.init(params)
    xs, ys = jnp.asarray(x), jnp.asarray(y)

    @jax.jit
    def step(params, state):
        def loss(p):
            logits = module.apply(p, xs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, ys).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for _ in range(config.steps):
        params, state, value = step(params, state)
        losses.append(float(value))
    return module, params, losses


def _linear(x: np.ndarray, y: np.ndarray, train, test, names, seed: int) -> dict:
    report = linear.linear_probe(x[train], y[train], x[test], y[test], seed=seed,
                                 class_names=names)
    return {"top1": report["top1"], "best_C": report["best_C"]}


def _check_split(labels: np.ndarray, train: np.ndarray, test: np.ndarray,
                 class_names: tuple[str, ...]) -> None:
    """Refuse a split that leaves a class out of training or testing: its scores would be of
    the other classes alone, set against a chance that counts it."""
    for cls in np.unique(labels):
        if not ((labels[train] == cls).any() and (labels[test] == cls).any()):
            name = class_names[cls] if cls < len(class_names) else str(cls)
            count = int((labels == cls).sum())
            raise DataError(f"class {name!r} has {count} video{'s' * (count != 1)}: too few "
                             "for both the training and the test split (at least 3 a class)")


def video_probe(
    frames: np.ndarray,
    labels: np.ndarray,
    class_names: tuple[str, ...] = (),
    seed: int = 0,
    attention: AttentionConfig = AttentionConfig(),  # noqa: B008 - frozen
    test_fraction: float = 0.25,
) -> dict:
    """Middle-frame and temporal-mean linear heads and the attention head on one split."""
    frames = np.asarray(frames, np.float32)
    labels = np.asarray(labels, np.int64)
    if frames.ndim != 3 or len(frames) != len(labels):
        raise ValueError(f"want frame features [N, K, d] for N labels; got {list(frames.shape)} "
                         f"for {len(labels)} labels")
    n, k, _ = frames.shape
    num_classes = num_classes_of(labels, names=class_names)
    train, test = split_indices(labels, (1 - test_fraction, test_fraction), seed)
    _check_split(labels, train, test, class_names)
    x = standardised(frames, train)
    module, params, losses = train_attention(x[train], labels[train], num_classes, attention,
                                             seed)
    logits = np.asarray(jax.jit(module.apply)(params, jnp.asarray(x[test])))
    return {
        "probe": "video",
        "num_videos": n,
        "frames_per_video": k,
        "middle_frame_index": k // 2,
        "num_train": len(train),
        "num_test": len(test),
        "num_classes": num_classes,
        "class_names": list(class_names),
        "middle_frame": _linear(frames[:, k // 2], labels, train, test, class_names, seed),
        "temporal_mean": _linear(frames.mean(axis=1), labels, train, test, class_names, seed),
        "attention": {
            **classification_scores(logits, labels[test]),
            "config": asdict(attention),
            "final_train_loss": losses[-1],
        },
        "baselines": trivial_baselines(labels[train], labels[test], num_classes),
    }


@dataclass
class VideoFeatures:
    """Per-frame features of N videos with their labels (aligned on N)."""

    frames: np.ndarray  # [N, K, d]
    labels: np.ndarray  # [N]
    class_names: tuple[str, ...]
    timestamps: np.ndarray | None = None  # [N, K] seconds
    meta: dict = field(default_factory=dict)  # model, preprocessing hash, source

    def __post_init__(self) -> None:
        """Finite real features of at least one frame and dimension per video, one integer
        class index per video (float labels were truncated, complex features lost their
        imaginary parts, a label of 10^12 asked the attention head for 10^12 outputs)."""
        self.frames = real_array(self.frames, "frames")
        if self.frames.ndim != 3 or 0 in self.frames.shape:
            raise DataError(f"frame features must be [videos, frames, width], each at least 1, "
                            f"got shape {list(self.frames.shape)}")
        check_finite(self.frames, "frames")
        self.labels = np.asarray(self.labels)
        check_class_indices("labels", self.labels)
        if len(self.labels) != len(self.frames):
            raise DataError(f"labels has {len(self.labels)} entries for {len(self.frames)} "
                            "videos: one per video, in the features' order")
        check_class_names(self.class_names, self.labels)
        if self.timestamps is not None and np.shape(self.timestamps) != self.frames.shape[:2]:
            raise DataError(f"timestamps of shape {list(np.shape(self.timestamps))} for frames "
                            f"{list(self.frames.shape[:2])}: one per frame")

    def __len__(self) -> int:
        return len(self.frames)


def run_video(data: VideoFeatures, seed: int = 0, steps: int | None = None) -> dict:
    """The video probe on ``data``; ``steps`` overrides the attention head's training steps."""
    config = AttentionConfig() if steps is None else AttentionConfig(steps=steps)
    two_classes(data.labels, "video probe")
    report = video_probe(data.frames, data.labels, data.class_names, seed=seed, attention=config)
    if data.timestamps is not None:
        report["mean_timestamps_s"] = np.asarray(data.timestamps).mean(axis=0).tolist()
    return {**report, "features": dict(data.meta)}
