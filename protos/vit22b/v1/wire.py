"""Wire helpers shared by the server and the client SDK: tensors, dtype and output-kind names.

numpy (and ml_dtypes for bfloat16) only: the client imports this, so no jax here. Tensors are
C-order little-endian bytes + dtype + shape (features.proto); bfloat16 arrays are
``ml_dtypes.bfloat16`` numpy arrays, so they round-trip without an upcast.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np
from vit22b.model.errors import quoted
from vit22b.v1 import features_pb2 as pb

if sys.byteorder != "little":  # bfloat16 has no byte-swapped numpy dtype; keep the contract simple
    raise ImportError("vit22b's wire format needs a little-endian host")

DTYPES: dict[str, int] = {
    "float32": pb.DTYPE_FLOAT32,
    "bfloat16": pb.DTYPE_BFLOAT16,
    "float16": pb.DTYPE_FLOAT16,
    "uint8": pb.DTYPE_UINT8,
}
OUTPUT_DTYPES = ("float32", "bfloat16", "float16")
_NUMPY = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    pb.DTYPE_FLOAT16: np.dtype("<f2"),
    pb.DTYPE_UINT8: np.dtype("u1"),
}

OUTPUT_KINDS: dict[str, int] = {
    "pooled": pb.OUTPUT_KIND_POOLED,
    "class_token": pb.OUTPUT_KIND_CLASS_TOKEN,
    "patch_tokens": pb.OUTPUT_KIND_PATCH_TOKENS,
    "attention_stats": pb.OUTPUT_KIND_ATTENTION_STATS,
    "logits": pb.OUTPUT_KIND_LOGITS,
    "register_tokens": pb.OUTPUT_KIND_REGISTER_TOKENS,
    "pre_projection": pb.OUTPUT_KIND_PRE_PROJECTION,
}
KIND_NAMES = {code: name for name, code in OUTPUT_KINDS.items()}
# Response tensor fields (besides the patch_tokens map) and the output kind each belongs to.
TENSOR_FIELDS = {
    "pooled": "pooled",
    "class_token": "class_token",
    "attention_entropy": "attention_stats",
    "attention_max_logit": "attention_stats",
    "logits": "logits",
    "register_tokens": "register_tokens",
    "pre_projection": "pre_projection",
}


class WireError(ValueError):
    """A tensor, dtype or output kind that does not follow the contract."""


def dtype_code(name: str) -> int:
    try:
        return DTYPES[name]
    except KeyError:
        raise WireError(f"unknown dtype {quoted(name)}; known: {', '.join(DTYPES)}") from None


def dtype_name(code: int) -> str:
    for name, value in DTYPES.items():
        if value == code:
            return name
    raise WireError(f"unknown dtype code {code}")


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a wire dtype's name (``bfloat16``: ml_dtypes')."""
    return _NUMPY[dtype_code(name)]


def output_dtype(code: int) -> str:
    """The output dtype a request asks for (unspecified means float32)."""
    name = "float32" if code == pb.DTYPE_UNSPECIFIED else dtype_name(code)
    if name not in OUTPUT_DTYPES:
        raise WireError(f"dtype {name} is not an output dtype; choose one of {OUTPUT_DTYPES}")
    return name


def kind_code(name: str) -> int:
    try:
        return OUTPUT_KINDS[name]
    except KeyError:
        known = ", ".join(OUTPUT_KINDS)
        raise WireError(f"unknown output kind {quoted(name)}; known: {known}") from None


def kind_name(code: int) -> str:
    try:
        return KIND_NAMES[code]
    except KeyError:
        known = ", ".join(f"{v}={k}" for k, v in OUTPUT_KINDS.items())
        raise WireError(f"unknown output kind {code}; known: {known}") from None


def to_tensor(array: np.ndarray, dtype: str | None = None) -> pb.Tensor:
    """A numpy array as a Tensor message, cast to ``dtype`` (name) first if given."""
    array = np.asarray(array)
    target = numpy_dtype(dtype) if dtype else array.dtype
    if target not in _NUMPY.values():
        raise WireError(f"arrays of dtype {array.dtype} cannot travel; use one of {list(DTYPES)}")
    array = np.ascontiguousarray(array, dtype=target)
    code = next(code for code, dt in _NUMPY.items() if dt == target)
    return pb.Tensor(dtype=code, shape=array.shape, data=array.tobytes())


MAX_TENSOR_DIMS = 8  # the service's tensors have at most 4; numpy holds at most 64


def from_tensor(tensor: pb.Tensor, copy: bool = True) -> np.ndarray:
    """The numpy array a Tensor message holds; checks dtype, shape and byte length agree."""
    dtype = _NUMPY.get(tensor.dtype)
    if dtype is None:
        raise WireError(f"tensor dtype {tensor.dtype} is unknown; known: {list(DTYPES)}")
    shape = tuple(tensor.shape)  # int64 values: Python ints
    if len(shape) > MAX_TENSOR_DIMS:
        raise WireError(f"tensor has {len(shape)} dimensions; at most {MAX_TENSOR_DIMS}")
    if shape and min(shape) < 0:
        raise WireError(f"tensor shape {list(shape)} has a negative dimension")
    count = math.prod(shape)
    # numpy's sizes are C integers; a zero-size array's other dimensions must fit too
    if (count or math.prod(s for s in shape if s)) * dtype.itemsize > sys.maxsize:
        raise WireError(f"tensor shape {list(shape)} is beyond any array's size")
    data = tensor.data  # one read: each read of a bytes field makes a new bytes object
    if len(data) != count * dtype.itemsize:
        raise WireError(
            f"tensor of shape {list(shape)} and dtype {dtype_name(tensor.dtype)} needs "
            f"{count * dtype.itemsize} bytes, got {len(data)}"
        )
    array = np.frombuffer(data, dtype=dtype).reshape(shape)
    return array.copy() if copy else array


def row_shapes(
    info: pb.ModelInfo, kinds: Sequence[str], layers: Sequence[int], num_patches: int = 0
) -> dict[str, tuple]:
    """Per-image shape of every tensor a request returns, from the model's info
    (``num_patches``: the request geometry's, or at most that; 0: the model's own)."""
    shapes: dict[str, tuple] = {}
    if "pooled" in kinds:
        shapes["pooled"] = (info.pooled_dim or info.width,)
    if "pre_projection" in kinds:
        shapes["pre_projection"] = (info.width,)
    if "register_tokens" in kinds:
        shapes["register_tokens"] = (info.num_registers, info.width)
    if "class_token" in kinds:
        shapes["class_token"] = (info.width,)
    if "attention_stats" in kinds:
        shapes["attention_entropy"] = shapes["attention_max_logit"] = (info.depth, info.heads)
    if "logits" in kinds:
        shapes["logits"] = (info.num_classes,)
    for layer in layers:
        shapes[f"patch_tokens[{layer}]"] = (num_patches or info.num_patches, info.width)
    return shapes


def empty_outputs(
    info: pb.ModelInfo, kinds: Sequence[str], layers: Sequence[int], dtype: str,
    num_patches: int = 0,
) -> tuple[dict[str, np.ndarray], dict[int, np.ndarray]]:
    """Each output a request asks for with no rows (every image refused), and its patch
    tokens by layer as spelled: a caller reads the same keys and row shapes either way."""
    numpy = numpy_dtype(dtype)
    arrays = {name: np.zeros((0, *shape), numpy)
              for name, shape in row_shapes(info, kinds, layers, num_patches).items()}
    return arrays, {layer: arrays.pop(f"patch_tokens[{layer}]") for layer in layers}


def patches_at(info: pb.ModelInfo, resolution: int = 0, dense: bool = False) -> int:
    """Patches per image at a request's geometry (dense: at most the server's bound)."""
    if dense:
        return info.limits.max_dense_patches or info.num_patches
    if not resolution or resolution == info.preprocessing.image_size:
        return info.num_patches
    patch = json.loads(info.config_json)["patch"] if info.config_json else 1
    return (resolution // patch) ** 2


def row_bytes(
    info: pb.ModelInfo, kinds: Sequence[str], layers: Sequence[int], dtype: str,
    num_patches: int = 0,
) -> int:
    """Bytes of one image's outputs in a response (tensor payload only)."""
    itemsize = numpy_dtype(dtype).itemsize
    shapes = row_shapes(info, kinds, layers, num_patches)
    return sum(math.prod(s) for s in shapes.values()) * itemsize


# Trailing metadata of a refusal caused by one image: its index in the request (or stream
# message). The message names it too ("image N ..."), at that index.
IMAGE_INDEX = "vit22b-image-index"

# Message-size accounting, the same on both sides so the client's requests always fit the
# server's limit: per image its id and field framing, per message the rest (model reference,
# timings, tensor headers).
MESSAGE_SLACK = 4096


def utf8_bytes(text: str) -> int:
    return len(text.encode())


def image_overhead(image_id: str, id_bytes: Callable[[str], int] = utf8_bytes) -> int:
    """An image's share of a message beside its tensors: its id as the message's encoding
    writes it (``id_bytes``; protobuf's is UTF-8) and its fields' framing."""
    return id_bytes(image_id) + 32


def response_bytes(row: int, ids: list[str], id_bytes: Callable[[str], int] = utf8_bytes) -> int:
    """Upper bound of a response's size for images with these ids, ``row`` bytes each."""
    return sum(row + image_overhead(i, id_bytes) for i in ids) + MESSAGE_SLACK


def model_ref(identity) -> pb.ModelRef:
    """A ``ModelIdentity`` (model/identity.py) as the wire's ModelRef."""
    return pb.ModelRef(
        name=identity.name,
        fingerprint=identity.fingerprint,
        preprocess_hash=identity.preprocess_hash,
        compute_dtype=identity.compute_dtype,
    )


def identity_of(info: pb.ModelInfo):
    """The ``ModelIdentity`` a server reports in its ModelInfo."""
    from vit22b.model.identity import ModelIdentity  # jax-free

    return ModelIdentity(
        name=info.model.name,
        fingerprint=info.model.fingerprint,
        preprocess_hash=info.model.preprocess_hash,
        compute_dtype=info.model.compute_dtype,
        source=info.source,
        width=info.width,
        pooled_dim=info.pooled_dim or info.width,
        depth=info.depth,
        num_patches=info.num_patches,
        outputs=tuple(kind_name(code) for code in info.outputs),
    )


def identity_of_ref(ref: pb.ModelRef) -> tuple[str, str, str, str]:
    """The comparable part of a response's ModelRef (``ModelIdentity.key``)."""
    return (ref.name, ref.fingerprint, ref.preprocess_hash, ref.compute_dtype)
