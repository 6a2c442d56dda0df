"""The client SDK: ``FeatureClient`` and ``AsyncFeatureClient`` (grpcio, numpy, pillow; no jax).

Exports load on first use, so ``vit22b --help`` (the CLI lives in this package) stays instant.
"""

from __future__ import annotations

from vit22b.model.lazy import lazy_exports

_EXPORTS = {
    "FeatureClient": "client",
    "FeatureError": "client",
    "Retry": "client",
    "AsyncFeatureClient": "aio",
    "EmbedSession": "session",
    "AsyncEmbedSession": "session",
    "Embeddings": "embeddings",
    "ImageError": "embeddings",
    "MixedModelsError": "embeddings",
    "InvalidImage": "client",
    "Sampling": "video",
    "VideoError": "video",
    "VideoEmbedding": "video_features",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
