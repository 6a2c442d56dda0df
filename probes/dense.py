"""Dense probes on frozen patch tokens: depth (linear and DPT-style decoders) and segmentation.

Decoders read the patch tokens of several layers as grids [N, g, g, d] (plus, optionally, the
pooled feature broadcast to every token) and predict at a few times the token resolution; the
prediction is then resized bilinearly to the label's pixels, where the loss and the metrics are
computed. They train with optax (Adam) on standardised features; only the decoder learns.

- ``linear``: one linear map per token to an ``sub x sub`` block of outputs (a linear decoder
  with sub-patch resolution), then bilinear upsampling (DINOv2's linear heads, with a finer
  output grid).
- ``dpt``: DPT's reassemble (project each layer, resample layer ``i`` of ``L`` by
  ``2**(L-2-i)``, so the earliest layer is the finest) and fusion (residual conv units, coarse
  to fine, each stage upsampled to the next), then a small conv head.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from .data import IGNORE_INDEX, DataError
from .features import Features, standardised


@dataclass
class DenseInputs:
    """Standardised decoder inputs: per-layer token grids and the pooled feature."""

    layers: tuple[np.ndarray, ...]  # each [N, g, g, d]
    pooled: np.ndarray | None  # [N, d]

    def take(self, index) -> DenseInputs:
        pooled = None if self.pooled is None else self.pooled[index]
        return DenseInputs(tuple(x[index] for x in self.layers), pooled)


def dense_inputs(
    features: Features, layers: tuple[int, ...], use_pooled: bool, train_index: np.ndarray
) -> DenseInputs:
    """Token grids of ``layers`` (and the pooled feature), standardised with training statistics."""
    grids = tuple(standardised(features.patch_grid(layer), train_index) for layer in layers)
    sides = {layer: grid.shape[1] for layer, grid in zip(layers, grids)}
    if len(set(sides.values())) > 1:  # the decoders stack the layers token by token
        raise DataError("the layers' patch grids differ (" + ", ".join(
            f"layer {layer}: {side}x{side}" for layer, side in sides.items()) + "): one "
            "grid for every layer a decoder reads")
    pooled = standardised(features.require("pooled"), train_index) if use_pooled else None
    return DenseInputs(grids, pooled)


def _with_pooled(x: jax.Array, pooled: jax.Array | None) -> jax.Array:
    if pooled is None:
        return x
    tiled = jnp.broadcast_to(pooled[:, None, None, :], x.shape[:3] + pooled.shape[-1:])
    return jnp.concatenate([x, tiled], axis=-1)


class LinearDecoder(nn.Module):
    out_channels: int
    sub: int = 4  # output pixels per token side, before the bilinear upsampling

    @nn.compact
    def __call__(self, layers, pooled):
        x = _with_pooled(jnp.concatenate(layers, axis=-1), pooled)
        b, g, _, _ = x.shape
        s, c = self.sub, self.out_channels
        y = nn.Dense(s * s * c)(x).reshape(b, g, g, s, s, c)
        return y.transpose(0, 1, 3, 2, 4, 5).reshape(b, g * s, g * s, c)


class ResidualConvUnit(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        y = nn.Conv(self.features, (3, 3))(nn.relu(x))
        y = nn.Conv(self.features, (3, 3))(nn.relu(y))
        return x + y


class DPTDecoder(nn.Module):
    out_channels: int
    features: int = 16

    @nn.compact
    def __call__(self, layers, pooled):
        f, depth = self.features, len(layers)
        maps = []
        for i, tokens in enumerate(layers):
            if pooled is not None:  # DPT's "project" readout: mix the global feature into tokens
                tokens = nn.gelu(nn.Dense(tokens.shape[-1])(_with_pooled(tokens, pooled)))
            x = nn.Dense(f)(tokens)
            factor = 2.0 ** (depth - 2 - i)
            if factor > 1:
                k = int(factor)
                x = nn.ConvTranspose(f, (k, k), strides=(k, k))(x)
            elif factor < 1:
                x = nn.Conv(f, (3, 3), strides=(2, 2))(x)
            maps.append(x)
        x = ResidualConvUnit(f)(maps[-1])
        for skip in reversed(maps[:-1]):
            x = jax.image.resize(x, skip.shape[:3] + (f,), "bilinear")
            x = ResidualConvUnit(f)(x + skip)  # DPT has a second unit on the skip: CPU-costly
        x = nn.gelu(nn.Conv(f // 2, (3, 3))(x))
        return nn.Conv(self.out_channels, (1, 1))(x)


# decoder -> (module class, Adam learning rate that trains it well in a few hundred steps)
DECODERS = {"linear": (LinearDecoder, 3e-2), "dpt": (DPTDecoder, 3e-3)}


def make_decoder(kind: str, out_channels: int) -> tuple[nn.Module, float]:
    if kind not in DECODERS:
        raise ValueError(f"unknown decoder {kind!r}; choose from {sorted(DECODERS)}")
    module, learning_rate = DECODERS[kind]
    return module(out_channels), learning_rate


def downsample_depth(depth: np.ndarray, stride: int) -> np.ndarray:
    """Mean over ``stride x stride`` blocks (the training resolution of depth targets)."""
    n, h, w = depth.shape[:3]
    if stride == 1:
        return depth
    if h % stride or w % stride:
        raise ValueError(f"label size {h}x{w} is not divisible by train_stride={stride}")
    return depth.reshape(n, h // stride, stride, w // stride, stride, *depth.shape[3:]).mean((2, 4))


def downsample_mask(mask: np.ndarray, stride: int) -> np.ndarray:
    """Every ``stride``-th pixel (labels cannot be averaged)."""
    return mask[:, stride // 2 :: stride, stride // 2 :: stride]


def _to_pixels(y: jax.Array, size: tuple[int, int]) -> jax.Array:
    return jax.image.resize(y, (y.shape[0], *size, y.shape[-1]), "bilinear")


def init_decoder(decoder: nn.Module, inputs: DenseInputs, rng: np.random.Generator):
    """LeCun-normal kernels and zero biases (Flax's defaults), drawn with numpy from the shapes
    ``eval_shape`` gives: compiling Flax's init costs seconds per conv on CPU."""
    shapes = jax.eval_shape(decoder.init, jax.random.key(0), *_batch(inputs, np.arange(1)))

    def draw(path, leaf):
        if path[-1].key != "kernel":
            return jnp.zeros(leaf.shape, leaf.dtype)
        fan_in = int(np.prod(leaf.shape[:-1]))
        return jnp.asarray(rng.standard_normal(leaf.shape) / np.sqrt(fan_in), leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def train_decoder(
    decoder: nn.Module,
    inputs: DenseInputs,
    targets: np.ndarray,
    loss_fn,
    steps: int = 300,
    batch_size: int = 32,
    learning_rate: float = 3e-3,
    weight_decay: float = 1e-4,
    seed: int = 0,
):
    """Adam(W) on mini-batches; returns the trained parameters and the loss curve."""
    size = targets.shape[1:3]
    rng = np.random.default_rng(seed)
    params = init_decoder(decoder, inputs, rng)
    schedule = optax.cosine_decay_schedule(learning_rate, steps)
    optimizer = optax.adamw(schedule, weight_decay=weight_decay)
    state = optimizer.init(params)

    @jax.jit
    def step(params, state, layers, pooled, target):
        def loss(p):
            return loss_fn(_to_pixels(decoder.apply(p, layers, pooled), size), target)

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for index in _minibatches(len(targets), batch_size, steps, rng):
        params, state, value = step(params, state, *_batch(inputs, index), targets[index])
        losses.append(float(value))
    return params, losses


def _minibatches(n: int, batch_size: int, steps: int, rng: np.random.Generator):
    """``steps`` index batches of one fixed size (one jit shape): reshuffled every epoch."""
    batch_size = min(batch_size, n)
    per_epoch = n // batch_size
    for i in range(steps):
        if i % per_epoch == 0:
            order = rng.permutation(n)
        start = (i % per_epoch) * batch_size
        yield order[start : start + batch_size]


def _batch(inputs: DenseInputs, index):
    layers = tuple(jnp.asarray(x[index]) for x in inputs.layers)
    return layers, None if inputs.pooled is None else jnp.asarray(inputs.pooled[index])


def predict(decoder, params, inputs: DenseInputs, size, trained_at=None,
            batch_size: int = 64) -> np.ndarray:
    """Decoder outputs at pixel resolution [N, H, W, C] (batches padded to one compiled shape),
    through ``trained_at``, the (h, w) its loss saw: what that resize averaged away was never
    trained (the initial weights' noise, scored at full resolution), so the prediction is that
    resolution's, upsampled (``benchmarks/dense_stride.py`` sets it against full-resolution
    training)."""
    forward = jax.jit(partial(_predict_batch, decoder, size=size, trained_at=trained_at))
    n = len(inputs.layers[0])
    batch_size = min(batch_size, n)
    out = []
    for start in range(0, n, batch_size):
        index = np.arange(start, start + batch_size) % n  # the last batch wraps around
        out.append(np.asarray(forward(params, *_batch(inputs, index)))[: n - start])
    return np.concatenate(out)


def _predict_batch(decoder, params, layers, pooled, size, trained_at=None):
    out = decoder.apply(params, layers, pooled)
    if trained_at is not None and tuple(trained_at) != tuple(size):
        out = _to_pixels(out, trained_at)
    return _to_pixels(out, size)


# ------------------------------------------------------------------------------------------
# depth
# ------------------------------------------------------------------------------------------


# Depth at or below this, or not finite, is no measurement (sensors' holes: KITTI's and NYU's
# raw maps hold 0 there, others NaN): left out of the statistics, the loss and the metrics.
MIN_DEPTH = 1e-3


def measured(depth: np.ndarray, min_depth: float = MIN_DEPTH) -> np.ndarray:
    """The pixels that hold a depth (finite and above ``min_depth``)."""
    depth = np.asarray(depth, np.float64)
    return np.isfinite(depth) & (depth > min_depth)


def depth_metrics(pred: np.ndarray, target: np.ndarray, min_depth: float = MIN_DEPTH) -> dict:
    """MSE, RMSE, AbsRel = mean |p - t| / t, and delta<1.25 = share with max(p/t, t/p) < 1.25,
    over the measured pixels of ``target``."""
    pred = np.maximum(np.asarray(pred, np.float64), min_depth)
    target = np.asarray(target, np.float64)
    valid = measured(target, min_depth)
    p, t = pred[valid], target[valid]
    mse = float(np.mean((p - t) ** 2))
    return {
        "mse": mse,
        "rmse": mse**0.5,
        "abs_rel": float(np.mean(np.abs(p - t) / t)),
        "delta1": float(np.mean(np.maximum(p / t, t / p) < 1.25)),
    }


def depth_probe(
    features: Features,
    depth: np.ndarray,
    train_index: np.ndarray,
    test_index: np.ndarray,
    layers: tuple[int, ...],
    decoders: tuple[str, ...] = ("linear", "dpt"),
    use_pooled: bool = True,
    steps: int = 300,
    train_stride: int = 2,
    seed: int = 0,
) -> tuple[dict, dict[str, np.ndarray]]:
    """Train each decoder on the training images' depth (standardised, pooled to 1/train_stride
    resolution); metrics on the test images at full resolution.

    Returns the report and the test predictions by decoder ([N_test, H, W], for the PNG).
    """
    depth = np.asarray(depth, np.float64)  # float32 squares of depths over ~1e19 overflow
    valid = measured(depth)
    for name, index in (("training", train_index), ("test", test_index)):
        if not valid[index].any():
            raise ValueError(f"the {name} images hold no measured depth (every pixel is "
                             f"non-finite or <= {MIN_DEPTH})")
    largest = depth[valid].max()
    with np.errstate(over="ignore"):  # the mean and errors' squares would overflow
        overflows = not np.isfinite(largest**2 * valid.sum())
    if overflows:
        raise ValueError(f"depths up to {largest:.3g}: their squares overflow float64, so no "
                         "error of them can be measured; give the depths in another unit")
    inputs = dense_inputs(features, layers, use_pooled, train_index)
    train_depth = depth[train_index][valid[train_index]]
    mean, std = float(train_depth.mean()), float(train_depth.std())
    std = std or 1.0  # a constant depth: nothing to scale (dividing by 0 gave NaN)
    # Channel 0 the standardised depth (0 where none), channel 1 the share of measured pixels
    # behind it: the loss weighs each training pixel by it.
    weight = valid[train_index].astype(np.float64)
    scaled = np.where(valid[train_index], (depth[train_index] - mean) / std, 0.0)
    if depth.shape[1] % train_stride or depth.shape[2] % train_stride:  # KITTI's 375 rows
        train_stride = 1  # no whole blocks to average: trained at full resolution (the report says)
    block_weight = downsample_depth(weight, train_stride)
    block_depth = downsample_depth(scaled, train_stride) / np.maximum(block_weight, 1e-12)
    target = np.stack([block_depth, block_weight], axis=-1).astype(np.float32)
    size = depth.shape[1:3]
    per_pixel = np.where(valid[train_index], depth[train_index], 0.0).sum(0)
    counts = valid[train_index].sum(0)
    per_pixel = np.where(counts > 0, per_pixel / np.maximum(counts, 1), mean)

    def mse(pred, tgt):  # over the measured pixels
        error = (pred[..., 0] - tgt[..., 0]) ** 2
        return jnp.sum(error * tgt[..., 1]) / jnp.maximum(jnp.sum(tgt[..., 1]), 1e-6)

    report = {
        "probe": "depth",
        "layers": list(layers),
        "pooled": use_pooled,
        "steps": steps,
        "train_stride": train_stride,
        "num_train": len(train_index),
        "num_test": len(test_index),
        "measured_pixels": float(valid.mean()),
        "baselines": {
            "mean_depth": depth_metrics(np.full_like(depth[test_index], mean), depth[test_index]),
            "per_pixel_mean_depth": depth_metrics(
                np.broadcast_to(per_pixel, depth[test_index].shape), depth[test_index]
            ),
        },
    }
    predictions = {}
    for kind in decoders:
        decoder, learning_rate = make_decoder(kind, 1)
        params, losses = train_decoder(
            decoder,
            inputs.take(train_index),
            target,
            mse,
            steps,
            learning_rate=learning_rate,
            seed=seed,
        )
        standard = predict(decoder, params, inputs.take(test_index), size,
                           trained_at=target.shape[1:3])[..., 0]
        pred = standard.astype(np.float64) * std + mean  # float32 would overflow past ~3e38
        predictions[kind] = pred
        report[kind] = {**depth_metrics(pred, depth[test_index]), "final_train_loss": losses[-1]}
    return report, predictions


# ------------------------------------------------------------------------------------------
# segmentation
# ------------------------------------------------------------------------------------------




def _classes_in_range(name: str, labels: np.ndarray, num_classes: int,
                      ignore_index: int | None) -> None:
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        hint = "" if ignore_index is None else f" (pixels labelled {ignore_index} are ignored)"
        raise ValueError(f"{name} classes must be in 0..{num_classes - 1}, got "
                         f"{labels.min()}..{labels.max()}{hint}")


def segmentation_metrics(pred: np.ndarray, target: np.ndarray, num_classes: int,
                         ignore_index: int | None = None) -> dict:
    """Pixel accuracy and mean IoU over the classes present in the labels or the predictions.

    IoU of a class = |pred & target| / |pred | target| summed over all test pixels; pixels whose
    target is ``ignore_index`` are not counted (whatever was predicted there).
    """
    # int64: uint8 masks would overflow target * num_classes
    pred, target = np.asarray(pred).ravel().astype(np.int64), np.asarray(target).ravel()
    target = target.astype(np.int64)
    if pred.shape != target.shape:
        raise ValueError(f"{pred.size} predicted pixels for {target.size} labelled ones")
    if ignore_index is not None:
        kept = target != ignore_index
        pred, target = pred[kept], target[kept]
    for name, labels in (("prediction", pred), ("target", target)):
        _classes_in_range(name, labels, num_classes, ignore_index)
    if not target.size:
        raise ValueError("no labelled pixel to score: every target pixel is ignored")
    # per class, from counts alone (a C x C confusion matrix of 65,536 classes is 32 GiB)
    inter = np.bincount(target[pred == target], minlength=num_classes).astype(np.float64)
    union = (np.bincount(pred, minlength=num_classes) + np.bincount(target, minlength=num_classes)
             - inter)
    present = union > 0
    iou = np.where(present, inter / np.maximum(union, 1), np.nan)
    return {
        "pixel_accuracy": float(inter.sum() / target.size),
        "miou": float(np.nanmean(iou)),
        "iou_per_class": [None if np.isnan(v) else float(v) for v in iou],
    }


def pixel_cross_entropy(logits: jax.Array, labels: jax.Array,
                        ignore_index: int | None = None) -> jax.Array:
    """Mean softmax cross-entropy over the pixels whose label is not ``ignore_index``."""
    if ignore_index is None:
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    counted = labels != ignore_index
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits, jnp.where(counted, labels, 0))  # any class: those losses are weighted 0
    return jnp.sum(losses * counted) / jnp.maximum(counted.sum(), 1)


def segmentation_probe(
    features: Features,
    mask: np.ndarray,
    num_classes: int,
    train_index: np.ndarray,
    test_index: np.ndarray,
    layers: tuple[int, ...],
    use_pooled: bool = False,
    steps: int = 300,
    train_stride: int = 2,
    seed: int = 0,
    ignore_index: int | None = IGNORE_INDEX,
) -> tuple[dict, np.ndarray]:
    """Linear decoder with per-pixel softmax cross-entropy (trained on every train_stride-th
    pixel); mIoU and pixel accuracy on the test images at full resolution. Pixels labelled
    ``ignore_index`` (None: every label is a class) count nowhere."""
    mask = np.asarray(mask, np.int32)
    labelled = mask if ignore_index is None else mask[mask != ignore_index]
    if not labelled.size:
        raise ValueError(f"every mask pixel is labelled {ignore_index}, the ignore index")
    _classes_in_range("mask", labelled, num_classes, ignore_index)
    inputs = dense_inputs(features, layers, use_pooled, train_index)
    decoder, learning_rate = make_decoder("linear", num_classes)

    cross_entropy = partial(pixel_cross_entropy, ignore_index=ignore_index)
    train_mask = downsample_mask(mask[train_index], train_stride)
    params, losses = train_decoder(
        decoder,
        inputs.take(train_index),
        train_mask,
        cross_entropy,
        steps,
        learning_rate=learning_rate,
        seed=seed,
    )
    pred = predict(decoder, params, inputs.take(test_index), mask.shape[1:3],
                   trained_at=train_mask.shape[1:3]).argmax(-1)
    train_labels = mask[train_index].ravel()
    if ignore_index is not None:
        train_labels = train_labels[train_labels != ignore_index]
    if not train_labels.size:
        raise ValueError("the training images have no labelled pixel (all are the ignore index)")
    majority = int(np.bincount(train_labels, minlength=num_classes).argmax())
    test_mask = mask[test_index]
    report = {
        "probe": "segmentation",
        "layers": list(layers),
        "pooled": use_pooled,
        "steps": steps,
        "train_stride": train_stride,
        "num_classes": num_classes,
        "ignore_index": ignore_index,
        "ignored_pixels": 0 if ignore_index is None else int((mask == ignore_index).sum()),
        "num_train": len(train_index),
        "num_test": len(test_index),
        "linear": {
            **segmentation_metrics(pred, test_mask, num_classes, ignore_index),
            "final_train_loss": losses[-1],
        },
        "baselines": {
            "majority_class": majority,
            **{
                f"majority_{k}": v
                for k, v in segmentation_metrics(
                    np.full_like(test_mask, majority), test_mask, num_classes, ignore_index
                ).items()
                if k != "iou_per_class"
            },
        },
    }
    return report, pred
