"""The backbone and its vocabulary.

jax-free modules (importable with the client install): ``config`` (configs and presets),
``outputs`` (the output request), ``pixels`` (the pixel contract), ``features`` (the feature
container), ``identity`` (the model identity), ``errors`` (the plain failures), ``schema``
(kinds of JSON values, the check of a file read from outside). JAX/Flax modules:
``vit`` (the model), ``forward``, ``sharding``, ``checkpoint``, ``convert*``, ``info``.

Imports nothing of the server, the clients or the probes. Exports load on first use, so
``from vit22b.model import ViTConfig`` does not import jax.
"""

from __future__ import annotations

from .lazy import lazy_exports

_EXPORTS = {
    "DEFAULT_MODEL": "config",
    "PRESETS": "config",
    "ConfigError": "config",
    "Preprocess": "config",
    "ViTConfig": "config",
    "get_config": "config",
    "OutputRequest": "outputs",
    "Features": "features",
    "ModelIdentity": "identity",
    "ViT": "vit",
    "abstract_params": "vit",
    "apply": "vit",
    "attention_entropy": "vit",
    "init_params": "vit",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
