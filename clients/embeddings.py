"""The SDK's result: the feature container (``model/features.py``) with ids, errors and the model
that made them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from vit22b.model.features import FEATURE_FIELDS, Features
from vit22b.v1 import features_pb2 as pb
from vit22b.v1 import wire


class MixedModelsError(RuntimeError):
    """Responses came from servers with different models, weights, preprocessing or dtypes."""


@dataclass(frozen=True)
class ImageError:
    index: int  # position in the caller's input
    id: str
    reason: str


@dataclass
class Embeddings(Features):
    """Rows follow the input order (invalid images left out when skipped: see ``indices``).

    ``patch_tokens`` is keyed by the layers as requested. bfloat16 arrays are
    ``ml_dtypes.bfloat16``."""

    ids: list[str] = field(default_factory=list)
    indices: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    errors: list[ImageError] = field(default_factory=list)
    model: pb.ModelRef | None = None  # name, fingerprint, preprocessing hash, compute dtype
    timings: list[pb.Timings] = field(default_factory=list)  # one per request sent
    grid: tuple[int, int] | None = None  # (rows, cols) of the patch tokens' rows

    def __len__(self) -> int:
        return len(self.ids)

    def as_dict(self) -> dict:
        """The returned arrays by name (``patch_tokens`` as a dict by layer)."""
        out = dict(self.arrays())
        if self.patch_tokens:
            out["patch_tokens"] = dict(self.patch_tokens)
        return out


def from_response(response: pb.EmbedResponse, sent: Sequence[int]) -> Embeddings:
    """One response, its rows and errors indexed as the caller's inputs (``sent``: the caller's
    index of each image its request carried)."""
    # ListFields: only the fields the server set, in one call (a response carries a few of the
    # possible tensors; asking each by HasField costs more than the rest of this on small calls)
    arrays = {field.name: wire.from_tensor(value) for field, value in response.ListFields()
              if field.name in wire.TENSOR_FIELDS}
    tokens = response.patch_tokens
    patches = {int(k): wire.from_tensor(t) for k, t in tokens.items()} if tokens else {}
    ids, indices = list(response.ids), list(response.indices)
    rows = len(ids)
    if len(indices) != rows:
        raise wire.WireError(f"malformed response: {len(indices)} indices for {rows} ids")
    for name, array in arrays.items():
        _check_rows(name, array, rows)
    for layer, array in patches.items():
        _check_rows(f"patch_tokens[{layer}]", array, rows)
    return Embeddings(
        **arrays,
        patch_tokens=patches,
        ids=ids,
        indices=np.array([_sent(sent, i) for i in indices], np.int64),
        errors=[ImageError(_sent(sent, e.index), e.id, e.reason) for e in response.errors],
        model=response.model,
        timings=[response.timings],
        grid=(response.grid_rows, response.grid_cols) if response.grid_rows else None,
    )


def _check_rows(name: str, array: np.ndarray, rows: int) -> None:
    if array.ndim < 2 or array.shape[0] != rows:  # every output is [images, ...]
        raise wire.WireError(f"malformed response: {name} of shape {list(array.shape)} for "
                             f"{rows} images")


def _sent(sent: Sequence[int], index: int) -> int:
    """The caller's index of the request's ``index``-th image; a server's index outside the
    request is refused (a negative one would count from the end: another image's row)."""
    if not 0 <= index < len(sent):
        raise wire.WireError(f"malformed response: image index {index} is not one of the "
                             f"request's {len(sent)} images")
    return sent[index]


def merge(parts: Sequence[Embeddings]) -> Embeddings:
    """Concatenate per-request results in order; refuses results of different models."""
    if len(parts) == 1:  # one request (a session's call): it is the result
        return parts[0]
    models = {wire.identity_of_ref(p.model) for p in parts if p.model is not None}
    if len(models) > 1:
        raise MixedModelsError(
            f"the servers returned features of different models / weights / preprocessing / "
            f"compute dtypes: {sorted(models)}; embeddings from them are not comparable"
        )
    with_rows = [p for p in parts if len(p)]
    grids = {p.grid for p in with_rows}
    if len(grids) > 1 and any(p.patch_tokens for p in with_rows):
        raise ValueError(
            f"these images give different patch grids ({sorted(grids)}): their patch tokens "
            "do not stack; use iter_embed (one result per request) for dense images"
        )
    # no rows at all: the outputs with none (each part's answer holds them), as one part's
    arrays = Features.concat(with_rows) if with_rows else (parts[0] if parts else Features())
    return Embeddings(
        **{name: getattr(arrays, name) for name in FEATURE_FIELDS},
        ids=[i for p in parts for i in p.ids],
        indices=np.concatenate([p.indices for p in parts]) if parts else np.zeros(0, np.int64),
        errors=sorted(
            [e for p in parts for e in p.errors], key=lambda e: e.index
        ),
        model=next((p.model for p in parts if p.model is not None), None),
        timings=[t for p in parts for t in p.timings],
        grid=grids.pop() if len(grids) == 1 else None,
    )
