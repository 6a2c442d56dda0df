"""Where the probes' features come from: arrays, a saved .npz, the model in-process, a server,
or a ``vit22b embed`` output folder. Every source ends as one :class:`Features`.

Keys follow the model's outputs (``vit22b.model.apply``): ``pooled`` [N, d], ``class_token``
[N, d], ``patch_tokens`` {layer: [N, P, d]}, ``attention_entropy`` / ``attention_max_logit``
[N, depth, heads], ``logits`` [N, C].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .data import DataError


@dataclass
class Features:
    """Features of N images, any subset of the model's outputs (numpy, float32)."""

    pooled: np.ndarray | None = None
    class_token: np.ndarray | None = None
    patch_tokens: dict[int, np.ndarray] = field(default_factory=dict)
    attention_entropy: np.ndarray | None = None
    attention_max_logit: np.ndarray | None = None
    logits: np.ndarray | None = None
    meta: dict = field(default_factory=dict)  # model name, preprocess hash, source

    def __len__(self) -> int:
        for value in (self.pooled, self.class_token, self.attention_entropy, self.logits):
            if value is not None:
                return len(value)
        for value in self.patch_tokens.values():
            return len(value)
        return 0

    def require(self, name: str) -> np.ndarray:
        """The named output, or a clear error saying how to ask for it."""
        value = getattr(self, name)
        if value is None or (isinstance(value, dict) and not value):
            source = self.meta.get("source", "the feature source")
            raise DataError(f"{source} has no {name!r} features; request them when embedding")
        return value

    def patch_grid(self, layer: int) -> np.ndarray:
        """Patch tokens of one layer as [N, g, g, d] (square grid, row-major like the model)."""
        tokens = self.require("patch_tokens")
        if layer not in tokens:
            raise DataError(f"no patch tokens of layer {layer}; available: {sorted(tokens)}")
        n, p, d = tokens[layer].shape
        g = int(round(p**0.5))
        if g * g != p:
            raise DataError(f"layer {layer}: {p} patch tokens do not form a square grid")
        return tokens[layer].reshape(n, g, g, d)

    def subset(self, index: np.ndarray) -> Features:
        """The features of the images ``index`` selects (for train / validation / test splits)."""

        def take(value):
            return None if value is None else value[index]

        return Features(
            pooled=take(self.pooled),
            class_token=take(self.class_token),
            patch_tokens={k: v[index] for k, v in self.patch_tokens.items()},
            attention_entropy=take(self.attention_entropy),
            attention_max_logit=take(self.attention_max_logit),
            logits=take(self.logits),
            meta=dict(self.meta),
        )


_ARRAY_KEYS = ("pooled", "class_token", "attention_entropy", "attention_max_logit", "logits")


def features_from_outputs(outputs: dict, meta: dict | None = None) -> Features:
    """The dict ``vit22b.model.apply`` (or a client) returns -> Features (as float32 numpy)."""
    arrays = {
        k: np.asarray(outputs[k], np.float32) for k in _ARRAY_KEYS if outputs.get(k) is not None
    }
    patches = {
        int(k): np.asarray(v, np.float32) for k, v in (outputs.get("patch_tokens") or {}).items()
    }
    return Features(patch_tokens=patches, meta=dict(meta or {}), **arrays)


def save_features(path: str | Path, features: Features) -> None:
    """One .npz (numpy alone opens it): the arrays, patch tokens as ``patch_tokens/<layer>``."""
    arrays = {k: getattr(features, k) for k in _ARRAY_KEYS if getattr(features, k) is not None}
    arrays |= {f"patch_tokens/{k}": v for k, v in features.patch_tokens.items()}
    arrays["meta"] = np.asarray(repr(sorted(features.meta.items())))
    np.savez(path, **arrays)


def load_npz_features(path: str | Path) -> Features:
    with np.load(path, allow_pickle=False) as npz:
        outputs: dict = {k: npz[k] for k in npz.files if k in _ARRAY_KEYS}
        outputs["patch_tokens"] = {
            int(k.split("/", 1)[1]): npz[k] for k in npz.files if k.startswith("patch_tokens/")
        }
    return features_from_outputs(outputs, {"source": str(path)})


def features_from_embed_folder(path: str | Path) -> Features:
    """Features of a ``vit22b embed`` output folder (shards + manifest).

    Not wired yet: the folder format is defined by the embed job (``vit22b.clients``); this is
    the one place that reads it into :class:`Features`.
    """
    raise NotImplementedError(
        f"{path}: reading `vit22b embed` output folders is not wired into the probes yet; "
        "save features with vit22b.probes.features.save_features (.npz) or use --server"
    )


def load_features(source) -> Features:
    """Features from any source: a Features, a dict of arrays, a .npz file or an embed folder."""
    if isinstance(source, Features):
        return source
    if isinstance(source, dict):
        return features_from_outputs(source, {"source": "arrays"})
    path = Path(source)
    if path.is_dir():
        return features_from_embed_folder(path)
    if path.suffix == ".npz" and path.is_file():
        return load_npz_features(path)
    raise DataError(f"{source}: not a features .npz file nor an embed output folder")


# ------------------------------------------------------------------------------------------
# computing features: in-process with the model, or from a server
# ------------------------------------------------------------------------------------------


def preprocess(images, cfg) -> np.ndarray:
    """uint8 images ([N, H, W, 3], or a list of [H, W, 3] of any sizes) -> the model's
    normalised input [N, S, S, 3], per ``cfg.preprocess``.

    Shorter side resized to ``preprocess.resize`` (PIL, the contract's interpolation), centre crop
    to ``cfg.image_size``, then ``(x / 255 - mean) / std``.
    """
    from PIL import Image

    pp, size = cfg.preprocess, cfg.image_size
    method = Image.BICUBIC if pp.interpolation == "bicubic" else Image.BILINEAR
    out = np.empty((len(images), size, size, 3), np.float32)
    for i, image in enumerate(images):
        h, w = image.shape[:2]
        scale = pp.resize / min(h, w)
        rh, rw = max(size, round(h * scale)), max(size, round(w * scale))
        im = Image.fromarray(image)
        if (rh, rw) != (h, w):
            im = im.resize((rw, rh), method)
        top, left = (rh - size) // 2, (rw - size) // 2
        out[i] = np.asarray(im.crop((left, top, left + size, top + size)), np.float32)
    mean, std = np.asarray(pp.mean, np.float32), np.asarray(pp.std, np.float32)
    return (out / 255.0 - mean) / std


def features_from_model(
    images: np.ndarray,
    model=None,
    params: dict | None = None,
    seed: int = 0,
    patch_layers: tuple[int, ...] = (),
    attention_stats: bool = False,
    logits: bool = False,
    batch_size: int = 64,
) -> Features:
    """Run the backbone in-process on uint8 images: ``model`` a preset name or a ViTConfig
    (default: the served default), random weights from ``seed`` unless ``params`` are given.
    For tests, demos and users without a server."""
    import jax
    from vit22b.model import (
        DEFAULT_MODEL,
        OutputRequest,
        ViTConfig,
        apply,
        get_config,
        init_params,
    )

    cfg = model if isinstance(model, ViTConfig) else get_config(model or DEFAULT_MODEL)
    random_weights = params is None
    if random_weights:  # jitted like the server's sharded init (and 3x faster than eager)
        params = jax.jit(lambda key: init_params(cfg, key))(jax.random.key(seed))
    request = OutputRequest(
        pooled=cfg.head != "none",
        patch_layers=tuple(patch_layers),
        attention_stats=attention_stats,
        logits=logits,
    )
    forward = jax.jit(lambda p, x: apply(cfg, p, x, request))
    chunks, batch_size = [], min(batch_size, len(images))
    for start in range(0, len(images), batch_size):
        batch = preprocess(images[start : start + batch_size], cfg)
        n = len(batch)  # pad the last batch: one compiled shape for all
        batch = np.pad(batch, ((0, batch_size - n), (0, 0), (0, 0), (0, 0)))
        chunks.append(jax.tree.map(lambda a, n=n: np.asarray(a)[:n], forward(params, batch)))
    outputs = jax.tree.map(lambda *xs: np.concatenate(xs), *chunks)
    meta = {
        "model": cfg.name,
        "preprocess_hash": cfg.preprocess_hash(),
        "num_tokens": cfg.num_tokens,
        "source": f"in-process {cfg.name} (seed {seed})" if random_weights else "in-process",
    }
    return features_from_outputs(outputs, meta)


def features_from_server(
    address: str,
    images,
    patch_layers: tuple[int, ...] = (),
    attention_stats: bool = False,
    logits: bool = False,
    batch_size: int = 64,
    **client_kwargs,
) -> Features:
    """Features from a running server through the SDK's ``FeatureClient``.

    Expects ``FeatureClient(address, **client_kwargs).embed(images, outputs=..., batch_size=...)``
    to return a dict shaped like ``vit22b.model.apply``'s outputs (numpy arrays).
    """
    from vit22b.clients import FeatureClient

    outputs = {
        "pooled": True,
        "patch_layers": tuple(patch_layers),
        "attention_stats": attention_stats,
        "logits": logits,
    }
    with FeatureClient(address, **client_kwargs) as client:
        result = client.embed(list(images), outputs=outputs, batch_size=batch_size)
    return features_from_outputs(dict(result), {"source": address})
