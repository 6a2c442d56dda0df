"""The SDK's result: numpy arrays per requested output, with ids and the model that made them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from vit22b.v1 import features_pb2 as pb
from vit22b.v1 import wire


class MixedModelsError(RuntimeError):
    """Responses came from servers with different models, weights or preprocessing."""


@dataclass(frozen=True)
class ImageError:
    index: int  # position in the caller's input
    id: str
    reason: str


@dataclass
class Embeddings:
    """Rows follow the input order (invalid images left out when skipped: see ``indices``).

    ``pooled`` / ``class_token`` [n, width]; ``patch_tokens`` {layer as requested: [n, patches,
    width]}; ``attention_entropy`` / ``attention_max_logit`` [n, depth, heads]; ``logits``
    [n, classes]. Outputs not requested are None. bfloat16 arrays are ``ml_dtypes.bfloat16``.
    """

    pooled: np.ndarray | None = None
    class_token: np.ndarray | None = None
    patch_tokens: dict[int, np.ndarray] = field(default_factory=dict)
    attention_entropy: np.ndarray | None = None
    attention_max_logit: np.ndarray | None = None
    logits: np.ndarray | None = None
    ids: list[str] = field(default_factory=list)
    indices: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    errors: list[ImageError] = field(default_factory=list)
    model: pb.ModelRef | None = None  # name, checkpoint fingerprint, preprocessing hash
    timings: list[pb.Timings] = field(default_factory=list)  # one per request sent

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, name: str):
        if name == "patch_tokens":
            return self.patch_tokens
        if name not in wire.TENSOR_FIELDS:
            raise KeyError(name)
        return getattr(self, name)

    def as_dict(self) -> dict:
        """The returned arrays by name (``patch_tokens`` as a dict by layer)."""
        out = {k: getattr(self, k) for k in wire.TENSOR_FIELDS if getattr(self, k) is not None}
        if self.patch_tokens:
            out["patch_tokens"] = dict(self.patch_tokens)
        return out


def from_response(response: pb.EmbedResponse, offset: int) -> Embeddings:
    """One response; ``offset`` turns the request's indices into the caller's."""
    result = Embeddings(
        patch_tokens={int(k): wire.from_tensor(t) for k, t in response.patch_tokens.items()},
        ids=list(response.ids),
        indices=np.asarray(response.indices, np.int64) + offset,
        errors=[ImageError(e.index + offset, e.id, e.reason) for e in response.errors],
        model=response.model,
        timings=[response.timings],
    )
    for name in wire.TENSOR_FIELDS:
        if response.HasField(name):
            setattr(result, name, wire.from_tensor(getattr(response, name)))
    return result


def merge(parts: Sequence[Embeddings], extra_errors: Sequence[ImageError] = ()) -> Embeddings:
    """Concatenate per-request results in order; refuses results of different models."""
    models = {
        (p.model.name, p.model.fingerprint, p.model.preprocess_hash)
        for p in parts
        if p.model is not None
    }
    if len(models) > 1:
        raise MixedModelsError(
            f"the servers returned features of different models / weights / preprocessing: "
            f"{sorted(models)}; embeddings from them are not comparable"
        )
    with_rows = [p for p in parts if len(p)]
    merged = Embeddings(
        ids=[i for p in parts for i in p.ids],
        indices=np.concatenate([p.indices for p in parts]) if parts else np.zeros(0, np.int64),
        errors=sorted(
            [e for p in parts for e in p.errors] + list(extra_errors), key=lambda e: e.index
        ),
        model=next((p.model for p in parts if p.model is not None), None),
        timings=[t for p in parts for t in p.timings],
    )
    for name in wire.TENSOR_FIELDS:
        arrays = [getattr(p, name) for p in with_rows]
        if arrays and arrays[0] is not None:
            setattr(merged, name, np.concatenate(arrays))
    if with_rows:
        merged.patch_tokens = {
            layer: np.concatenate([p.patch_tokens[layer] for p in with_rows])
            for layer in with_rows[0].patch_tokens
        }
    return merged
