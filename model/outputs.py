"""The output request: what a forward returns, checked against what a model has.

jax-free (the SDK, the job and the probes use it). One definition of the output kinds, their
defaults and the layer resolution: the server, the engine and every client spell requests with it.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Iterable, Sequence, Sized
from dataclasses import dataclass, replace

from .config import ViTConfig
from .errors import InvalidRequest, is_number, quoted

# The output kinds, in wire order (features.proto's OutputKind).
KINDS = (
    "pooled",
    "class_token",
    "patch_tokens",
    "attention_stats",
    "logits",
    "register_tokens",
    "pre_projection",
)
DEFAULT_KINDS = ("pooled",)
DEFAULT_PATCH_LAYERS = (-1,)  # patch tokens without layers: the last block's
_MISSING = {
    "pooled": "pooling head",
    "class_token": "class token",
    "logits": "classifier (no logits)",
    "register_tokens": "register tokens",
    "pre_projection": "projection after pooling (no pre-projection feature)",
}


def supported_kinds(cfg: ViTConfig) -> tuple[str, ...]:
    """The output kinds ``cfg`` can produce, in wire order."""
    has = {
        "pooled": cfg.head != "none",
        "class_token": cfg.class_token,
        "patch_tokens": True,
        "attention_stats": True,
        "logits": bool(cfg.num_classes),
        "register_tokens": cfg.num_registers > 0,
        "pre_projection": cfg.head != "none" and cfg.projection_dim > 0,
    }
    return tuple(kind for kind in KINDS if has[kind])


MAX_SPELLED = 1024  # outputs or layers one request may list, repeats included (depths are below)


def listed(value, one: type) -> Sequence:
    """A caller's list as given, or ``()`` for None, or a single item of type ``one`` as a list
    of it (``outputs="pooled"`` is one kind, not six letters; ``layers=-1`` one layer)."""
    if value is None:
        return ()
    return (value,) if isinstance(value, one) else value


def _layer(value) -> int:
    """A block index as spelled: an integer (1.5 is not layer 1), within the wire's int32."""
    if not is_number(value, numbers.Integral):
        raise InvalidRequest(f"layer {quoted(value)} is not an integer")
    if not -(2**31) <= value < 2**31:
        raise InvalidRequest(f"layer index {value} is out of range")
    return int(value)


def check_listed(what: str, items: Sized) -> None:
    """Refuses a list of ``what`` (outputs, layers) longer than ``MAX_SPELLED``: a door calls
    this before it converts a client's list item by item."""
    if len(items) > MAX_SPELLED:
        raise InvalidRequest(f"{len(items)} {what} requested; at most {MAX_SPELLED}")


@dataclass(frozen=True)
class OutputRequest:
    """What one forward returns; anything not asked for is not computed.

    ``patch_layers`` are block indices (0 is the first block); negative ones count from the end,
    like timm's ``forward_intermediates`` and DINOv2's ``get_intermediate_layers``.
    """

    pooled: bool = True
    class_token: bool = False
    patch_layers: tuple[int, ...] = ()
    attention_stats: bool = False
    norm_patches: bool = False  # apply the final norm to returned patch tokens (DINOv2 norm=True)
    logits: bool = False
    register_tokens: bool = False  # [B, R, d] after the final norm (DINOv2-reg, DINOv3)
    pre_projection: bool = False  # [B, d]: the pooled feature before the projection (CLIP)

    def __post_init__(self) -> None:
        if self.norm_patches and not self.patch_layers:  # as l2_normalize without pooled
            raise InvalidRequest("normalize_patches applies to patch tokens, which were not "
                                 "requested (ask for patch_tokens or layers)")

    @classmethod
    def of(
        cls,
        kinds: Iterable[str] = (),
        layers: Sequence[int] = (),
        norm_patches: bool = False,
    ) -> OutputRequest:
        """From kind names and layers as a caller spells them: no kinds means pooled; layers
        imply patch tokens; patch tokens without layers mean the last block's.

        Every request of every door is spelled here, mostly the same few ways: the spellings
        are remembered (``_spelled``, bounded), which makes this a look-up. So a spelling is
        bounded too (``MAX_SPELLED``), checked before anything is built from it: the cache would
        otherwise hold every client's longest list (a 38 MB list of layers pinned 150 MB)."""
        layers = listed(layers, numbers.Integral)
        check_listed("layers", layers)
        kinds = tuple(listed(kinds, str))
        check_listed("outputs", kinds)
        spelling = (kinds, tuple(layers), bool(norm_patches))
        try:
            hash(spelling)
        except TypeError:  # an unhashable layer: spelled anew, to the same error or result
            return cls._spell(*spelling)
        return _spelled(spelling)

    @classmethod
    def _spell(cls, kinds: tuple, layers: tuple, norm_patches: bool) -> OutputRequest:
        kinds = set(kinds) or (set() if layers else set(DEFAULT_KINDS))
        unknown = sorted(kinds - set(KINDS))
        if unknown:
            raise InvalidRequest(f"unknown output {quoted(unknown[0])}; known: {', '.join(KINDS)}")
        layers = tuple(dict.fromkeys(_layer(layer) for layer in layers))
        if "patch_tokens" in kinds and not layers:
            layers = DEFAULT_PATCH_LAYERS
        return cls(
            pooled="pooled" in kinds,
            class_token="class_token" in kinds,
            patch_layers=layers,
            attention_stats="attention_stats" in kinds,
            norm_patches=norm_patches,
            logits="logits" in kinds,
            register_tokens="register_tokens" in kinds,
            pre_projection="pre_projection" in kinds,
        )

    @property
    def kinds(self) -> tuple[str, ...]:
        """The requested output kinds, in wire order."""
        on = {
            "pooled": self.pooled,
            "class_token": self.class_token,
            "patch_tokens": bool(self.patch_layers),
            "attention_stats": self.attention_stats,
            "logits": self.logits,
            "register_tokens": self.register_tokens,
            "pre_projection": self.pre_projection,
        }
        return tuple(kind for kind in KINDS if on[kind])

    def layers(self, depth: int) -> tuple[int, ...]:
        """Requested layers as non-negative indices, sorted and unique; range-checked."""
        resolved = []
        for layer in self.patch_layers:
            index = layer + depth if layer < 0 else layer
            if not 0 <= index < depth:
                raise InvalidRequest(
                    f"layer index {layer} is out of range for a model of depth {depth} "
                    f"(valid: {-depth}..{depth - 1})"
                )
            resolved.append(index)
        return tuple(sorted(set(resolved)))

    def resolve(self, cfg: ViTConfig) -> OutputRequest:
        """The canonical request for ``cfg`` (layers non-negative, sorted): the compile-cache
        key. Raises ``InvalidRequest`` for layers out of range or outputs the model lacks."""
        resolved = replace(self, patch_layers=self.layers(cfg.depth))
        if not resolved.kinds:
            raise InvalidRequest("no outputs requested")
        supported = supported_kinds(cfg)
        for kind in resolved.kinds:
            if kind not in supported:
                raise InvalidRequest(
                    f"model {cfg.name} has no {_MISSING[kind]} (its outputs: "
                    f"{', '.join(supported)})"
                )
        return resolved


POOLED = OutputRequest()  # the default output set


@functools.lru_cache(maxsize=256)  # bounded: a caller may spell many layer sets
def _spelled(spelling: tuple) -> OutputRequest:
    return OutputRequest._spell(*spelling)
