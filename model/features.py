"""The feature container: what a forward returns for N images, as host numpy arrays.

jax-free. One definition used by the engine, the batcher, the facade, the SDK (``Embeddings``
adds ids and errors) and the probes: ``concat`` / ``take`` move rows, ``finish`` is the
per-request step on the host (L2 normalisation of pooled features).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np

# Array fields besides ``patch_tokens`` ({block index: [n, patches, width]}).
ARRAYS = (
    "pooled",
    "class_token",
    "attention_entropy",
    "attention_max_logit",
    "logits",
    "register_tokens",
    "pre_projection",
)


@dataclass
class Features:
    """``pooled`` / ``class_token`` [n, width]; ``patch_tokens`` {layer: [n, patches, width]};
    ``attention_entropy`` / ``attention_max_logit`` [n, depth, heads]; ``logits`` [n, classes];
    ``register_tokens`` [n, registers, width]; ``pre_projection`` [n, width].
    Outputs not computed are None (``patch_tokens``: empty)."""

    pooled: np.ndarray | None = None
    class_token: np.ndarray | None = None
    patch_tokens: dict[int, np.ndarray] = field(default_factory=dict)
    attention_entropy: np.ndarray | None = None
    attention_max_logit: np.ndarray | None = None
    logits: np.ndarray | None = None
    register_tokens: np.ndarray | None = None  # [n, registers, width]
    pre_projection: np.ndarray | None = None  # [n, width]: pooled before the projection

    @classmethod
    def from_tree(cls, tree: Mapping) -> Features:
        """The model's output dict (host arrays) -> Features."""
        unknown = set(tree) - {*ARRAYS, "patch_tokens"}
        if unknown:
            raise ValueError(f"unknown outputs {sorted(unknown)}")
        patches = {int(k): np.asarray(v) for k, v in tree.get("patch_tokens", {}).items()}
        return cls(patch_tokens=patches, **{k: np.asarray(tree[k]) for k in ARRAYS if k in tree})

    def arrays(self) -> Iterator[tuple[str, np.ndarray]]:
        """(name, array) of every computed output besides patch tokens."""
        for name in ARRAYS:
            value = getattr(self, name)
            if value is not None:
                yield name, value

    def __getitem__(self, name: str):
        """An output by name (``patch_tokens``: the dict by layer)."""
        if name not in FEATURE_FIELDS:
            raise KeyError(name)
        return getattr(self, name)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for _, a in self.arrays()) + sum(
            a.nbytes for a in self.patch_tokens.values()
        )

    def __len__(self) -> int:
        for _, value in self.arrays():
            return len(value)
        for value in self.patch_tokens.values():
            return len(value)
        return 0

    def as_tree(self) -> dict:
        """The computed outputs as the model's output dict (``patch_tokens`` by layer)."""
        return {**dict(self.arrays()), "patch_tokens": dict(self.patch_tokens)}

    def _map(self, fn) -> dict:
        """Keyword arguments of a copy with ``fn`` applied to every array."""
        out = {name: fn(value) for name, value in self.arrays()}
        out["patch_tokens"] = {layer: fn(value) for layer, value in self.patch_tokens.items()}
        return out

    def astype(self, dtype) -> Features:
        """A copy in ``dtype``; values beyond its range become Inf (``non_finite_rows`` finds
        them), without numpy's overflow warning."""
        with np.errstate(over="ignore"):
            return replace(self, **self._map(lambda a: a.astype(dtype)))

    def take(self, rows) -> Features:
        """The given rows (a slice or an index array), in that order."""
        return replace(self, **self._map(lambda a: a[rows]))

    @classmethod
    def concat(cls, parts: Sequence[Features]) -> Features:
        """Row-wise concatenation of several batches' outputs (the same outputs each)."""
        first = parts[0]
        if len(parts) == 1:
            return first
        out = {
            name: np.concatenate([getattr(p, name) for p in parts]) for name, _ in first.arrays()
        }
        out["patch_tokens"] = {
            layer: np.concatenate([p.patch_tokens[layer] for p in parts])
            for layer in first.patch_tokens
        }
        return replace(first, **out)

    def finish(self, l2_normalize: bool) -> Features:
        """Per-request finishing on the host: optional L2 normalisation of pooled features."""
        if not (l2_normalize and self.pooled is not None):
            return self
        norm = np.linalg.norm(self.pooled, axis=-1, keepdims=True)
        return replace(self, pooled=self.pooled / np.maximum(norm, np.float32(1e-12)))

    def non_finite_rows(self) -> np.ndarray:
        """Indices of rows with a NaN or Inf in any output (refused, never returned)."""
        bad = np.zeros(len(self), bool)
        for _, value in [*self.arrays(), *self.patch_tokens.items()]:
            flat = np.asarray(value, np.float32).reshape(len(value), -1)
            bad |= ~np.isfinite(flat).all(axis=1)
        return np.flatnonzero(bad)


FEATURE_FIELDS = tuple(f.name for f in fields(Features))
