from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]

class OutputKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_KIND_UNSPECIFIED: _ClassVar[OutputKind]
    OUTPUT_KIND_POOLED: _ClassVar[OutputKind]
    OUTPUT_KIND_CLASS_TOKEN: _ClassVar[OutputKind]
    OUTPUT_KIND_PATCH_TOKENS: _ClassVar[OutputKind]
    OUTPUT_KIND_ATTENTION_STATS: _ClassVar[OutputKind]
    OUTPUT_KIND_LOGITS: _ClassVar[OutputKind]
    OUTPUT_KIND_REGISTER_TOKENS: _ClassVar[OutputKind]
    OUTPUT_KIND_PRE_PROJECTION: _ClassVar[OutputKind]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
DTYPE_UINT8: DType
OUTPUT_KIND_UNSPECIFIED: OutputKind
OUTPUT_KIND_POOLED: OutputKind
OUTPUT_KIND_CLASS_TOKEN: OutputKind
OUTPUT_KIND_PATCH_TOKENS: OutputKind
OUTPUT_KIND_ATTENTION_STATS: OutputKind
OUTPUT_KIND_LOGITS: OutputKind
OUTPUT_KIND_REGISTER_TOKENS: OutputKind
OUTPUT_KIND_PRE_PROJECTION: OutputKind

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("id", "encoded", "pixels")
    ID_FIELD_NUMBER: _ClassVar[int]
    ENCODED_FIELD_NUMBER: _ClassVar[int]
    PIXELS_FIELD_NUMBER: _ClassVar[int]
    id: str
    encoded: bytes
    pixels: Tensor
    def __init__(self, id: _Optional[str] = ..., encoded: _Optional[bytes] = ..., pixels: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("images", "outputs", "patch_layers", "dtype", "l2_normalize", "normalize_patches", "skip_invalid_images", "resolution", "dense")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PATCH_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    L2_NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_PATCHES_FIELD_NUMBER: _ClassVar[int]
    SKIP_INVALID_IMAGES_FIELD_NUMBER: _ClassVar[int]
    RESOLUTION_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[Image]
    outputs: _containers.RepeatedScalarFieldContainer[OutputKind]
    patch_layers: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    l2_normalize: bool
    normalize_patches: bool
    skip_invalid_images: bool
    resolution: int
    dense: bool
    def __init__(self, images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[OutputKind, str]]] = ..., patch_layers: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., l2_normalize: _Optional[bool] = ..., normalize_patches: _Optional[bool] = ..., skip_invalid_images: _Optional[bool] = ..., resolution: _Optional[int] = ..., dense: _Optional[bool] = ...) -> None: ...

class ImageError(_message.Message):
    __slots__ = ("index", "id", "reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    reason: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ModelRef(_message.Message):
    __slots__ = ("name", "fingerprint", "preprocess_hash", "compute_dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_HASH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    fingerprint: str
    preprocess_hash: str
    compute_dtype: str
    def __init__(self, name: _Optional[str] = ..., fingerprint: _Optional[str] = ..., preprocess_hash: _Optional[str] = ..., compute_dtype: _Optional[str] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_ms", "preprocess_ms", "compute_ms", "total_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    preprocess_ms: float
    compute_ms: float
    total_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., preprocess_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("model", "ids", "indices", "pooled", "class_token", "patch_tokens", "attention_entropy", "attention_max_logit", "logits", "errors", "timings", "register_tokens", "pre_projection", "grid_rows", "grid_cols")
    class PatchTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: Tensor
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    CLASS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_MAX_LOGIT_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    REGISTER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRE_PROJECTION_FIELD_NUMBER: _ClassVar[int]
    GRID_ROWS_FIELD_NUMBER: _ClassVar[int]
    GRID_COLS_FIELD_NUMBER: _ClassVar[int]
    model: ModelRef
    ids: _containers.RepeatedScalarFieldContainer[str]
    indices: _containers.RepeatedScalarFieldContainer[int]
    pooled: Tensor
    class_token: Tensor
    patch_tokens: _containers.MessageMap[int, Tensor]
    attention_entropy: Tensor
    attention_max_logit: Tensor
    logits: Tensor
    errors: _containers.RepeatedCompositeFieldContainer[ImageError]
    timings: Timings
    register_tokens: Tensor
    pre_projection: Tensor
    grid_rows: int
    grid_cols: int
    def __init__(self, model: _Optional[_Union[ModelRef, _Mapping]] = ..., ids: _Optional[_Iterable[str]] = ..., indices: _Optional[_Iterable[int]] = ..., pooled: _Optional[_Union[Tensor, _Mapping]] = ..., class_token: _Optional[_Union[Tensor, _Mapping]] = ..., patch_tokens: _Optional[_Mapping[int, Tensor]] = ..., attention_entropy: _Optional[_Union[Tensor, _Mapping]] = ..., attention_max_logit: _Optional[_Union[Tensor, _Mapping]] = ..., logits: _Optional[_Union[Tensor, _Mapping]] = ..., errors: _Optional[_Iterable[_Union[ImageError, _Mapping]]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., register_tokens: _Optional[_Union[Tensor, _Mapping]] = ..., pre_projection: _Optional[_Union[Tensor, _Mapping]] = ..., grid_rows: _Optional[int] = ..., grid_cols: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Preprocessing(_message.Message):
    __slots__ = ("image_size", "resize", "interpolation", "mean", "std", "hash", "description")
    IMAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESIZE_FIELD_NUMBER: _ClassVar[int]
    INTERPOLATION_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    STD_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    image_size: int
    resize: int
    interpolation: str
    mean: _containers.RepeatedScalarFieldContainer[float]
    std: _containers.RepeatedScalarFieldContainer[float]
    hash: str
    description: str
    def __init__(self, image_size: _Optional[int] = ..., resize: _Optional[int] = ..., interpolation: _Optional[str] = ..., mean: _Optional[_Iterable[float]] = ..., std: _Optional[_Iterable[float]] = ..., hash: _Optional[str] = ..., description: _Optional[str] = ...) -> None: ...

class Mesh(_message.Message):
    __slots__ = ("spec", "axes", "platform", "num_devices")
    class AxesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SPEC_FIELD_NUMBER: _ClassVar[int]
    AXES_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICES_FIELD_NUMBER: _ClassVar[int]
    spec: str
    axes: _containers.ScalarMap[str, int]
    platform: str
    num_devices: int
    def __init__(self, spec: _Optional[str] = ..., axes: _Optional[_Mapping[str, int]] = ..., platform: _Optional[str] = ..., num_devices: _Optional[int] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_batch_images", "batch_buckets", "max_delay_ms", "max_queue_images", "max_request_images", "max_message_bytes", "max_image_pixels", "max_batch_patches", "resolutions", "max_dense_patches")
    MAX_BATCH_IMAGES_FIELD_NUMBER: _ClassVar[int]
    BATCH_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    MAX_DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_IMAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_IMAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_PATCHES_FIELD_NUMBER: _ClassVar[int]
    RESOLUTIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_DENSE_PATCHES_FIELD_NUMBER: _ClassVar[int]
    max_batch_images: int
    batch_buckets: _containers.RepeatedScalarFieldContainer[int]
    max_delay_ms: float
    max_queue_images: int
    max_request_images: int
    max_message_bytes: int
    max_image_pixels: int
    max_batch_patches: int
    resolutions: _containers.RepeatedScalarFieldContainer[int]
    max_dense_patches: int
    def __init__(self, max_batch_images: _Optional[int] = ..., batch_buckets: _Optional[_Iterable[int]] = ..., max_delay_ms: _Optional[float] = ..., max_queue_images: _Optional[int] = ..., max_request_images: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_image_pixels: _Optional[int] = ..., max_batch_patches: _Optional[int] = ..., resolutions: _Optional[_Iterable[int]] = ..., max_dense_patches: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "source", "config_json", "parameter_count", "width", "depth", "heads", "num_patches", "num_classes", "outputs", "dtypes", "preprocessing", "mesh", "limits", "server_version", "pooled_dim", "num_registers")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_PATCHES_FIELD_NUMBER: _ClassVar[int]
    NUM_CLASSES_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    PREPROCESSING_FIELD_NUMBER: _ClassVar[int]
    MESH_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    POOLED_DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_REGISTERS_FIELD_NUMBER: _ClassVar[int]
    model: ModelRef
    source: str
    config_json: str
    parameter_count: int
    width: int
    depth: int
    heads: int
    num_patches: int
    num_classes: int
    outputs: _containers.RepeatedScalarFieldContainer[OutputKind]
    dtypes: _containers.RepeatedScalarFieldContainer[DType]
    preprocessing: Preprocessing
    mesh: Mesh
    limits: Limits
    server_version: str
    pooled_dim: int
    num_registers: int
    def __init__(self, model: _Optional[_Union[ModelRef, _Mapping]] = ..., source: _Optional[str] = ..., config_json: _Optional[str] = ..., parameter_count: _Optional[int] = ..., width: _Optional[int] = ..., depth: _Optional[int] = ..., heads: _Optional[int] = ..., num_patches: _Optional[int] = ..., num_classes: _Optional[int] = ..., outputs: _Optional[_Iterable[_Union[OutputKind, str]]] = ..., dtypes: _Optional[_Iterable[_Union[DType, str]]] = ..., preprocessing: _Optional[_Union[Preprocessing, _Mapping]] = ..., mesh: _Optional[_Union[Mesh, _Mapping]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., server_version: _Optional[str] = ..., pooled_dim: _Optional[int] = ..., num_registers: _Optional[int] = ...) -> None: ...
