"""Where the probes' features come from: arrays, a saved .npz, the model in-process, a server,
or a ``vit22b embed`` output folder. Every source ends as one :class:`Features`.

Keys follow the model's outputs (``vit22b.model.apply``): ``pooled`` [N, d], ``class_token``
[N, d], ``patch_tokens`` {layer: [N, P, d]}, ``attention_entropy`` / ``attention_max_logit``
[N, depth, heads], ``logits`` [N, C].
"""

from __future__ import annotations

import functools
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

    def take(self, rows: np.ndarray) -> Features:
        """The features of the given rows, in that order."""
        pick = lambda a: None if a is None else a[rows]  # noqa: E731
        return Features(
            pooled=pick(self.pooled),
            class_token=pick(self.class_token),
            patch_tokens={k: v[rows] for k, v in self.patch_tokens.items()},
            attention_entropy=pick(self.attention_entropy),
            attention_max_logit=pick(self.attention_max_logit),
            logits=pick(self.logits),
            meta=dict(self.meta),
        )

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
    if not Path(path).is_file():
        raise DataError(f"{path}: not a features .npz file nor an embed output folder")
    with np.load(path, allow_pickle=False) as npz:
        outputs: dict = {k: npz[k] for k in npz.files if k in _ARRAY_KEYS}
        outputs["patch_tokens"] = {
            int(k.split("/", 1)[1]): npz[k] for k in npz.files if k.startswith("patch_tokens/")
        }
    return features_from_outputs(outputs, {"source": str(path)})


def features_from_embed_folder(path: str | Path) -> tuple[Features, list[str]]:
    """The features of a ``vit22b embed`` output folder and the image paths of its rows.

    Reads the stored arrays (``pooled``, ``class_token``, ``patch_tokens.<layer>``) with the
    embed job's numpy-only loader; bfloat16 outputs are widened to float32.
    """
    from vit22b.clients.outputs import OutputsError, open_outputs

    try:
        outputs = open_outputs(str(path))
    except OutputsError as err:
        raise DataError(str(err)) from None
    if not len(outputs):
        raise DataError(f"{path}: the embed output holds no embedded images yet")
    arrays: dict = {"patch_tokens": {}}
    for name in outputs.names:
        kind, _, layer = name.partition(".")
        value = np.asarray(outputs[name])
        if kind == "patch_tokens":
            arrays["patch_tokens"][int(layer)] = value
        else:
            arrays[kind] = value
    identity = outputs.manifest.get("identity", {})
    meta = {
        "source": str(path),
        "model": identity.get("model"),
        "checkpoint_fingerprint": identity.get("checkpoint_fingerprint"),
        "preprocess_hash": identity.get("preprocess_hash"),
    }
    return features_from_outputs(arrays, meta), outputs.paths


def load_features(source) -> Features:
    """Features from any source: a Features, a dict of arrays, a .npz file or an embed folder."""
    if isinstance(source, Features):
        return source
    if isinstance(source, dict):
        return features_from_outputs(source, {"source": "arrays"})
    path = Path(source)
    if path.is_dir():
        return features_from_embed_folder(path)[0]
    return load_npz_features(path)


# ------------------------------------------------------------------------------------------
# computing features: in-process with the model, or from a server
# ------------------------------------------------------------------------------------------


def evenly_spaced_layers(depth: int, count: int = 4) -> tuple[int, ...]:
    """``count`` blocks spread over the depth, ending at the last (DPT's choice: 2, 5, 8, 11 of
    a 12-block ViT-B); ``patch_layers="auto"`` asks for these."""
    return tuple(sorted({max(depth * q // count - 1, 0) for q in range(1, count + 1)}))


def _layers(patch_layers, depth: int) -> tuple[int, ...]:
    return evenly_spaced_layers(depth) if patch_layers == "auto" else tuple(patch_layers)


@functools.lru_cache(maxsize=2)
def _random_params(cfg, seed: int) -> dict:
    """Seeded weights, jitted like the server's sharded init (and 3x faster than eager)."""
    import jax
    from vit22b.model import init_params

    return jax.jit(lambda key: init_params(cfg, key))(jax.random.key(seed))


@functools.lru_cache(maxsize=8)
def _forward(cfg, request):
    """One jitted forward per (model, outputs): compiled once per batch shape."""
    import jax
    from vit22b.model import apply

    return jax.jit(lambda params, images: apply(cfg, params, images, request))


def features_from_model(
    images: np.ndarray,
    model=None,
    params: dict | None = None,
    seed: int = 0,
    patch_layers: tuple[int, ...] | str = (),
    attention_stats: bool = False,
    logits: bool = False,
    batch_size: int = 64,
) -> Features:
    """Run the backbone in-process on uint8 images ([N, H, W, 3] or a list of [H, W, 3]):
    ``model`` a preset name or a ViTConfig (default: the served default), random weights from
    ``seed`` unless ``params`` are given; ``patch_layers`` block indices or "auto" (4 evenly
    spaced). For tests, demos and users without a server."""
    import jax
    from vit22b.model import DEFAULT_MODEL, OutputRequest, ViTConfig, get_config
    from vit22b.model.pixels import Preprocessor

    cfg = model if isinstance(model, ViTConfig) else get_config(model or DEFAULT_MODEL)
    random_weights = params is None
    if random_weights:
        params = _random_params(cfg, seed)
    request = OutputRequest(
        pooled=cfg.head != "none",
        patch_layers=_layers(patch_layers, cfg.depth),
        attention_stats=attention_stats,
        logits=logits,
    )
    forward = _forward(cfg, request)
    pre = Preprocessor(cfg)  # the server's own preprocessing: the same pixels as served
    chunks, batch_size = [], min(batch_size, len(images))
    for start in range(0, len(images), batch_size):
        batch = np.stack(
            [
                _load(pre, image, start + i)
                for i, image in enumerate(images[start : start + batch_size])
            ]
        )
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


def _load(pre, image, index: int) -> np.ndarray:
    from vit22b.model.errors import InvalidImage

    try:
        return pre.load(np.asarray(image))
    except InvalidImage as err:
        raise DataError(f"image {index}: {err.reason}") from None


def features_from_server(
    address: str,
    images,
    patch_layers: tuple[int, ...] | str = (),
    attention_stats: bool = False,
    logits: bool = False,
    batch_size: int | None = None,
    **client_kwargs,
) -> Features:
    """Features of ``images`` (paths, bytes, PIL images or uint8 arrays) from a running server,
    through the SDK's ``FeatureClient`` (``client_kwargs``: token, tls, timeout, ...).

    ``patch_layers`` may count from the end (-1 is the last block), or be "auto" (4 evenly
    spaced); the returned patch tokens are keyed by the layers as requested.
    """
    import json

    from vit22b.clients import FeatureClient

    outputs = ["pooled"] + ["attention_stats"] * attention_stats + ["logits"] * logits
    with FeatureClient(address, **client_kwargs) as client:
        info = client.model_info()
        layers = _layers(patch_layers, info.depth)
        result = client.embed(list(images), outputs=outputs, layers=layers, batch_size=batch_size)
    config = json.loads(info.config_json or "{}")
    meta = {
        "source": address,
        "model": result.model.name if result.model else info.model.name,
        "checkpoint_fingerprint": info.model.fingerprint,
        "preprocess_hash": info.model.preprocess_hash,
        "num_tokens": info.num_patches + int(bool(config.get("class_token"))),
        "depth": info.depth,
    }
    return features_from_outputs(result.as_dict(), meta)
