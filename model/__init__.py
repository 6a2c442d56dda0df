"""The backbone: configs and presets, the ViT, sharding rules, checkpoints and weight import.

Pure JAX/Flax; imports nothing of the server or the client.
"""

from .config import DEFAULT_MODEL, PRESETS, ConfigError, Preprocess, ViTConfig, get_config
from .vit import OutputRequest, ViT, abstract_params, apply, attention_entropy, init_params

__all__ = [
    "DEFAULT_MODEL",
    "PRESETS",
    "ConfigError",
    "OutputRequest",
    "Preprocess",
    "ViT",
    "ViTConfig",
    "abstract_params",
    "apply",
    "attention_entropy",
    "get_config",
    "init_params",
]
