"""The client SDK: ``FeatureClient`` and ``AsyncFeatureClient`` (grpcio, numpy, pillow; no jax).

Exports load on first use, so ``vit22b --help`` (the CLI lives in this package) stays instant.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "FeatureClient": "client",
    "FeatureError": "client",
    "Retry": "client",
    "AsyncFeatureClient": "aio",
    "Embeddings": "embeddings",
    "ImageError": "embeddings",
    "MixedModelsError": "embeddings",
    "InvalidImage": "client",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
