"""The model identity: what made a feature, carried by every response and every stored manifest.

jax-free. Features are comparable only when ``key`` agrees: the same model, the same weights
(fingerprint), the same preprocessing contract (hash) and the same compute dtype (bf16 and f32
features differ beyond rounding). The sizes beside it tell a client what shapes to expect.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .config import ViTConfig
from .outputs import supported_kinds

# how a manifest and a report name ``ModelIdentity.key``'s fields
KEY_NAMES = ("model", "checkpoint_fingerprint", "preprocess_hash", "compute_dtype")


@dataclass(frozen=True)
class ModelIdentity:
    name: str
    fingerprint: str  # of the parameters (checkpoint metadata, or computed for seeded weights)
    preprocess_hash: str
    compute_dtype: str
    source: str = ""  # where the weights came from: "init:seed=0", "timm:...", ...
    width: int = 0
    pooled_dim: int = 0  # the projection's width where there is one, else ``width``
    depth: int = 0
    num_patches: int = 0
    outputs: tuple[str, ...] = ()  # the output kinds the model supports

    @classmethod
    def of(cls, cfg: ViTConfig, fingerprint: str, source: str) -> ModelIdentity:
        return cls(
            name=cfg.name,
            fingerprint=fingerprint,
            preprocess_hash=cfg.preprocess_hash(),
            compute_dtype=cfg.compute_dtype,
            source=source,
            width=cfg.width,
            pooled_dim=cfg.pooled_dim,
            depth=cfg.depth,
            num_patches=cfg.num_patches,
            outputs=supported_kinds(cfg),
        )

    def at(self, cfg: ViTConfig, geometry) -> ModelIdentity:
        """This identity for features at a ``pixels.Geometry``: its contract's hash and patch
        count (dense: the geometry's bound, which a dense job pads every image's rows to)."""
        from .pixels import Preprocessor  # Pillow: only when a geometry is asked for

        pre = Preprocessor(cfg, geometry)
        if pre.geometry.dense:
            if not pre.geometry.max_patches:
                raise ValueError("dense features without a patch bound have no one shape")
            return replace(self, preprocess_hash=pre.hash, num_patches=pre.geometry.max_patches)
        side = pre.geometry.resolution // cfg.patch
        return replace(self, preprocess_hash=pre.hash, num_patches=side * side)

    @property
    def key(self) -> tuple[str, str, str, str]:
        """What must agree for two features to be comparable."""
        return (self.name, self.fingerprint, self.preprocess_hash, self.compute_dtype)

    def described(self) -> dict[str, str]:
        """``key`` by ``KEY_NAMES``, as an embed manifest and a probe's report record it."""
        return dict(zip(KEY_NAMES, self.key, strict=True))


def seeded_source(seed: int) -> str:
    return f"init:seed={seed}"
