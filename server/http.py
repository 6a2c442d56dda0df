"""The HTTP door: JSON over HTTP on the facade, beside gRPC in the same process and event loop.

Routes: ``POST /v1/embeddings`` (OpenAI-compatible: pooled features, L2-normalised, as OpenAI's
embeddings are), ``POST /v1/features`` (everything ``Embed`` offers; JSON with base64 tensors, or
with ``Accept: application/vnd.safetensors`` one safetensors body), ``GET /health`` (liveness),
``GET /ready`` (SERVING or not), ``GET /v1/models`` (the model info), and the OpenAPI document
(``/openapi.json``, ``/docs``). Like the gRPC door it translates and maps statuses only: the
token and the body limit are checked before the body is read (``_Guard``), a gzip or deflate
body is inflated within that limit (``json_body``), the body becomes an
``EmbedCall`` (images as base64 or ``data:`` URIs; raw pixels as the proto's ``Image``, so both
doors read them alike), and the facade validates, admits and runs it. Failures map through
``status.py``'s table into an OpenAI-style error body that names the image index and reason.
Image URLs are refused: this server does not fetch. A client that disconnects, or whose
``X-Request-Timeout`` passes, has its images dropped before they are computed.

Slow or silent clients are bounded by the connection class (``http_connections.py``): headers
must be complete within ``--http-header-timeout`` (408, or a close when nothing was sent) and
under ``MAX_HEADER_BYTES`` (431), nor a response go unread for ``--http-body-timeout`` (the
connection is cut), and ``--http-max-connections`` bound the open connections (503); here, in
``_Guard``, a body may not stall for ``--http-body-timeout`` nor, after that long, average under
``--http-min-body-rate`` (408; read whole before admission, so a stalled or dripped one holds no
place in the queue).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import math
import re
import time
import zlib
from collections.abc import Callable
from typing import Literal

import grpc
import jiter
import numpy as np
import safetensors.numpy
import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from vit22b.model.errors import (
    CallerGone,
    DeadlineExpired,
    Draining,
    InvalidImage,
    InvalidRequest,
    NotReady,
    TooLarge,
    Unauthenticated,
    quoted,
)
from vit22b.model.features import ARRAYS
from vit22b.model.outputs import KINDS, MAX_SPELLED, POOLED, OutputRequest
from vit22b.model.pixels import Geometry
from vit22b.model.schema import real_number
from vit22b.v1 import features_pb2 as pb
from vit22b.v1 import wire

from .auth import Tokens
from .http_connections import BoundedConnection, ClientLimits, UvicornServer, listen
from .infer import EmbedCall, EmbedResult, ImageInput, Infer
from .metrics import Metrics
from .service import check_response_size, image_input, server_version
from .status import (
    INTERNAL,
    RETRY_AFTER_S,
    STATUSES,
    ConnectionRefusal,
    RequestTimeout,
    Status,
    UnsupportedBody,
    status_of,
)

log = logging.getLogger(__name__)

SAFETENSORS = "application/vnd.safetensors"
SAFETENSORS_MAX_HEADER = 100_000_000  # the safetensors library's own bound on a header
OPEN_PATHS = ("/health", "/ready", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")
ROUTES = {"/v1/embeddings", "/v1/features", "/v1/models", *OPEN_PATHS}  # metric labels
TIMEOUT_HEADER = "x-request-timeout"  # seconds; the call's deadline, like gRPC's
ARRIVED = "vit22b.arrived"  # the ASGI scope's key for when a request's headers were complete
# ---- request and response bodies (their schemas are the OpenAPI document's) -----------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Tensor(_Body):
    dtype: str = Field(description="float32, bfloat16, float16 or uint8")
    shape: list[int]  # its length is the image's to refuse (wire.from_tensor), not the call's
    data: str = Field(description="base64 of the little-endian C-order bytes")


class Image(_Body):
    id: str = ""
    data: str | None = Field(None, description="an encoded file (JPEG, PNG, WebP, AVIF, HEIC, "
                             "...) as base64 or a data: URI")
    pixels: Tensor | None = Field(None, description="raw uint8 [height, width, 3] pixels")


class FeaturesRequest(_Body):
    images: list[Image | str] = Field(description="images; a string is an image's `data`")
    outputs: list[str] = Field([], max_length=MAX_SPELLED,
                               description=f"{', '.join(KINDS)} (default: pooled; with "
                               "`layers` alone, those layers' patch tokens only)")
    layers: list[int] = Field([], max_length=MAX_SPELLED, description="blocks whose patch tokens "
                              "to return (negative count from the end; imply patch_tokens)")
    dtype: str = Field("float32", description="float32, bfloat16 or float16")
    l2_normalize: bool = Field(False, description="L2-normalise pooled features")
    normalize_patches: bool = Field(False, description="apply the final norm to patch tokens "
                                    "(which must be asked for)")
    skip_invalid: bool = Field(False, description="invalid images become errors beside the "
                               "others' features instead of failing the call")
    resolution: int = Field(0, ge=0, description="square input size (0: the model's own; "
                            "the allowed sizes: GET /v1/models, limits.resolutions)")
    dense: bool = Field(False, description="keep the aspect ratio: whole patches, no crop "
                        "(the grid comes back as `grid`)")


class EmbeddingsRequest(BaseModel):
    """OpenAI's embeddings request; fields OpenAI clients add and this server ignores pass."""

    model_config = ConfigDict(strict=True)
    input: str | list[str] = Field(description="one image or several: base64 or data: URIs")
    model: str
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: the little-endian float32 bytes of each embedding")
    dimensions: int | None = Field(None, description="only the model's width")
    user: str | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class Usage(BaseModel):
    prompt_tokens: int = Field(description="patches of the images (a ViT's tokens)")
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


class Liveness(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    status: Literal["SERVING"]


class ModelEntry(BaseModel):
    """OpenAI's model entry; beside its four keys, GetModelInfo's fields as proto JSON spells
    them (64-bit integers as numbers, output kinds and dtypes by name, config as an object)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelEntry]


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="the failure's class")
    code: str = Field(description="the gRPC status of the same failure")
    index: int | None = Field(None, description="the image at fault, when one is")
    id: str | None = Field(None, description="its id")
    reason: str | None = Field(None, description="what is wrong with it")


class ErrorBody(BaseModel):
    """Every refusal's body: OpenAI's error shape."""

    error: ErrorDetail


# What each refusal means, for the OpenAPI document (the statuses: server/status.py).
REFUSALS = {
    400: "malformed: the message names the image and the reason",
    401: "missing or wrong bearer token (a server with a token file)",
    408: "headers or body too slow",
    413: "a body or response over the message limit (a compressed body: once inflated)",
    415: "a body in a coding other than gzip or deflate, or not JSON (an image file, a form)",
    422: "NaN or Inf in the outputs in the asked dtype",
    429: "queue or compile cache full (Retry-After)",
    431: "headers over the limit",
    503: "draining, not ready, or too many connections (Retry-After)",
    504: "the X-Request-Timeout deadline passed; the images were not computed",
}
ANY_ROUTE = (408, 431, 503)  # the connection layer's, before any route
UNREAD = 499  # a caller that went away: nobody reads its answer, so no document declares it


class ImageError(BaseModel):
    index: int
    id: str
    reason: str


class FeaturesResponse(BaseModel):
    model: dict[str, str] = Field(description="name, fingerprint, preprocess_hash, "
                                  "compute_dtype: features compare only when all agree")
    ids: list[str]
    indices: list[int] = Field(description="the positions in the request of the returned rows")
    errors: list[ImageError]
    grid: list[int] = Field(description="[rows, cols] of the patch grid the images ran at")
    timings: dict[str, float]
    outputs: dict[str, Tensor | dict[str, Tensor]] = Field(
        description=f"{', '.join(ARRAYS)}: each a tensor, when asked; "
        "patch_tokens: {layer as requested: tensor}")


# ---- translation ---------------------------------------------------------------------------


_LINE_BREAKS = str.maketrans("", "", " \t\r\n")


def from_base64(text: str) -> bytes:
    """Strict base64, except for line breaks: `base64 FILE` and MIME wrap theirs at 76 columns."""
    return base64.b64decode(text.translate(_LINE_BREAKS), validate=True)


# A URL's scheme (RFC 3986 3.1, any case) and "://": never base64, whose alphabet has no ':'.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def image_bytes(text: str) -> bytes:
    """An image's ``data``: base64, or a ``data:`` URI with base64 data (scheme and the
    ``;base64`` marker in any case, as RFC 2397 reads them)."""
    if text[:5].lower() == "data:":
        head, comma, text = text.partition(",")
        if not comma or not head.lower().endswith(";base64"):
            raise InvalidImage("a data: URI must carry base64 data (data:image/png;base64,...)")
    elif _URL.match(text):
        scheme = text.partition(":")[0]
        raise InvalidImage(f"image URLs ({quoted(scheme)}://...) are not fetched (fetching is "
                           "off on this server): send the file as base64 or a data: URI")
    try:
        return from_base64(text)
    except (binascii.Error, ValueError) as err:
        hint = (": the standard alphabet (+ and /), not the URL-safe one (- and _)"
                if "-" in text or "_" in text else "")
        raise InvalidImage(f"image data is not base64 ({err}){hint}") from None


def _image(item: Image | str) -> ImageInput:
    if isinstance(item, str):
        item = Image(data=item)
    if (item.data is None) == (item.pixels is None):
        given = "both were set" if item.data is not None else "neither was set"
        return ImageInput(None, item.id, "set exactly one of `data` (an encoded file as base64 "
                                         f"or a data: URI) and `pixels` ({given})")
    if item.data is not None:
        try:
            return ImageInput(image_bytes(item.data), item.id)
        except InvalidImage as err:
            return ImageInput(None, item.id, err.reason)
    try:  # raw pixels read as the gRPC door reads them
        tensor = pb.Tensor(dtype=wire.dtype_code(item.pixels.dtype), shape=item.pixels.shape,
                           data=from_base64(item.pixels.data))
    except (wire.WireError, binascii.Error, ValueError) as err:
        return ImageInput(None, item.id, f"raw pixels: {err}")
    return image_input(pb.Image(id=item.id, pixels=tensor))


BASE64_RATIO = 4 / 3
FLOAT_TEXT_RATIO = 25 / 4  # a float32 in JSON: at most 24 characters and a comma, for 4 bytes

# Commas one image may bring to a body: its keys, a raw tensor's fields and shape, a data: URI's
# comma, and commas in its id. Base64 has none.
COMMAS_PER_IMAGE = 64


# Content codings a body may come in (RFC 9110 8.4): zlib reads both with its header detected
# (gzip's, or zlib's as HTTP's "deflate" is).
BODY_CODINGS = ("gzip", "x-gzip", "deflate")
# Media types that are not JSON whatever their bytes: a client that sends one meant a file
# upload, a form or another format (a safetensors body, the answers' own), and "Invalid JSON at
# column 1" would not tell it so. A form type whose body is a JSON object is read (``curl -d
# '{...}'`` sends one); text types and none are read as JSON.
NOT_JSON = ("multipart/", "image/", "video/", "audio/", "font/", "model/", "application/")
JSON_TYPES = ("application/json", "application/x-json", "application/x-www-form-urlencoded")


def json_body(headers: dict[bytes, bytes], body: bytes, limit: int) -> bytes:
    """A POST body as the JSON text to parse: inflated per its ``Content-Encoding`` (to at
    most ``limit`` bytes: a small compressed body may not become a large one), refused when
    its coding or media type is not one this door reads, and without a UTF-8 byte-order mark
    (RFC 8259 lets a reader ignore one; PowerShell writes it)."""
    codings = [c.strip().lower() for c in headers.get(b"content-encoding", b"").decode(
        "latin-1").split(",")]
    for coding in reversed([c for c in codings if c not in ("", "identity")]):
        if coding not in BODY_CODINGS:
            raise UnsupportedBody(f"request body in Content-Encoding {quoted(coding)}, which "
                                  "this server does not read: send it as it is, gzip or deflate")
        body = _inflated(body, coding, limit)
    media = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
    form = media == "application/x-www-form-urlencoded"
    json_type = media in JSON_TYPES and not form or media.endswith("+json")
    if media.startswith(NOT_JSON) and not json_type and not (form and body.lstrip()[:1] == b"{"):
        raise UnsupportedBody(f"request body is {quoted(media)}, not JSON: send a JSON object "
                              "(Content-Type: application/json) with each image base64-encoded "
                              "or as a data: URI (the schema: GET /openapi.json)")
    if body.startswith(b"\xef\xbb\xbf"):
        return body[3:]
    if body[:2] in (b"\xff\xfe", b"\xfe\xff") or len(body) >= 4 and _wide_text(body[:4]):
        raise InvalidRequest("request body is not UTF-8 (UTF-16 or UTF-32, by its first bytes): "
                             "JSON bodies are UTF-8 (RFC 8259)")
    if b"\x00" in body[:4]:
        raise InvalidRequest("request body starts with binary data (a NUL byte), not JSON text: "
                             "send a JSON object (the schema: GET /openapi.json)")
    return body


def _wide_text(head: bytes) -> bool:
    """JSON text in UTF-16 or UTF-32 by the zeros around its first ASCII characters (RFC 4627,
    section 3): 00 00 00 xx, 00 xx 00 xx, xx 00 00 00, xx 00 xx 00, each xx a character JSON
    text starts with (a safetensors header's length also starts xx 00 00 00)."""
    zeros = tuple(b == 0 for b in head)
    if zeros not in ((True, True, True, False), (True, False, True, False),
                     (False, True, True, True), (False, True, False, True)):
        return False
    return all(b in _JSON_START for b in head if b)


_JSON_START = frozenset(b' \t\r\n{["-0123456789tfn')


def _inflated(body: bytes, coding: str, limit: int) -> bytes:
    """``body`` decompressed, every gzip member of it, refused past ``limit`` bytes."""
    out: list[bytes] = []
    size = 0
    rest = body
    while True:
        reader = zlib.decompressobj(32 + zlib.MAX_WBITS)
        try:
            part = reader.decompress(rest, limit + 1 - size)
        except zlib.error as err:
            raise InvalidRequest(f"request body declared Content-Encoding {quoted(coding)} but "
                                 f"is not {coding} data ({err})") from None
        out.append(part)
        size += len(part)
        if size > limit or reader.unconsumed_tail:
            raise TooLarge(f"request body of {len(body)} bytes inflates ({coding}) to over the "
                           f"message limit of {limit} bytes (--max-message-mb); send fewer "
                           "images per request")
        if not reader.eof:
            raise InvalidRequest(f"request body declared Content-Encoding {quoted(coding)} but "
                                 f"its {coding} data ends early ({len(body)} bytes)")
        rest = reader.unused_data
        if not rest:
            return b"".join(out)


def _parse(body: bytes, model: type[BaseModel], max_commas: int):
    """``body`` validated as ``model``. pydantic builds every item of a list before it checks
    the list's length, holding the interpreter lock: a 64 MiB body of 20 million empty strings
    took 8.6 s, during which neither door answered anything. Outside strings a list has one
    comma per item after the first, so a body with more commas than a request of the allowed
    size can hold is refused unread, in the time of one scan."""
    commas = body.count(b",")
    if commas > max_commas:
        raise InvalidRequest(f"request body holds {commas} commas, more than a request of at most "
                             f"the allowed images, outputs and layers can ({max_commas}; "
                             "commas in ids count too)")
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as err:
        problems = [
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
            for e in err.errors(include_url=False)[:4]
        ]
        raise InvalidRequest(f"request body ({model.__name__}): {'; '.join(problems)}") from None
    _refuse_duplicate_keys(body, model)
    return parsed


def _refuse_duplicate_keys(body: bytes, model: type[BaseModel]) -> None:
    """pydantic (like ``json.loads``) keeps an object's last value under a repeated key: a body
    built by joining pieces would lose its first ``images`` without a word. Refused, as serde's
    derived readers (TEI's) refuse them; a second parse by the same parser (about 40 ms for
    60 MB of base64), after validation so every other fault keeps its own message."""
    try:
        jiter.from_json(body, catch_duplicate_keys=True)
    except ValueError as err:
        raise InvalidRequest(f"request body ({model.__name__}): {err}; each key once per "
                             "object") from None


def _deadline(request: Request) -> float | None:
    """``X-Request-Timeout`` counted from the request's arrival (its headers, as ``_Guard``
    saw them), as gRPC's deadline is: the body's upload, parsing and base64 included."""
    text = request.headers.get(TIMEOUT_HEADER)
    if text is None:
        return None
    try:
        seconds = real_number(text)
    except ValueError:
        seconds = math.nan
    if not seconds > 0 or math.isinf(seconds):
        raise InvalidRequest(f"X-Request-Timeout is seconds > 0, got {quoted(text)}")
    return request.scope.get(ARRIVED, time.monotonic()) + seconds


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _tensor(array: np.ndarray) -> dict:
    array = np.ascontiguousarray(array)
    return {"dtype": array.dtype.name, "shape": list(array.shape),
            "data": base64.b64encode(array.tobytes()).decode()}


_ROUTING = {404: ("NotFound", grpc.StatusCode.NOT_FOUND),
            405: ("MethodNotAllowed", grpc.StatusCode.UNIMPLEMENTED)}


async def _routing_error(request: Request, exc: StarletteHTTPException) -> Response:
    """No such path, or not that method on it: the refusals' own shape (``error_response``)."""
    kind, code = _ROUTING.get(exc.status_code, ("HTTPException", grpc.StatusCode.UNKNOWN))
    error = ErrorDetail(message=f"{exc.detail}: {request.method} {request.url.path}",
                        type=kind, code=code.name)
    return _json(ErrorBody(error=error).model_dump(exclude_none=True), exc.status_code,
                 dict(exc.headers or {}))


def _json_id_bytes(image_id: str) -> int:
    """An id as ``_json`` writes it: ASCII with escapes (an 'é' is 6 bytes, an emoji 12)."""
    return len(json.dumps(image_id))


def _safetensors_id_bytes(image_id: str) -> int:
    """An id in a safetensors body's metadata: JSON text (UTF-8) that the header's JSON
    escapes once more."""
    return len(json.dumps(json.dumps(image_id, ensure_ascii=False), ensure_ascii=False).encode())


def _check_safetensors_header(ids: list[str]) -> None:
    """safetensors refuses to write a header over its limit, whatever the message limit."""
    size = wire.response_bytes(0, ids, _safetensors_id_bytes)
    if size > SAFETENSORS_MAX_HEADER:
        raise TooLarge(f"the ids would make a safetensors header of about {size >> 20} MiB, "
                       f"over safetensors' limit of {SAFETENSORS_MAX_HEADER} bytes: send "
                       "shorter ids, or ask for JSON")


def _prefers_safetensors(accept: str) -> bool:
    """``Accept`` names safetensors with a weight (q) above 0 and not below JSON's."""
    weights = {}
    for part in accept.split(","):
        kind, *params = (p.strip() for p in part.split(";"))
        q = next((p[2:] for p in params if p[:2].lower() == "q="), "1")  # names: any case
        try:
            weights[kind.lower()] = float(q)
        except ValueError:
            weights[kind.lower()] = 0.0
    ours = weights.get(SAFETENSORS, 0.0)
    return ours > 0 and ours >= weights.get("application/json", 0.0)


def _json(body: dict, status: int = 200, headers: dict | None = None) -> Response:
    return Response(json.dumps(body, separators=(",", ":")), status, headers,
                    media_type="application/json")


def error_response(err: BaseException, status: Status) -> Response:
    """OpenAI's error shape, plus the gRPC code name and, for one image, its index and reason."""
    error = ErrorDetail(message=str(err) or type(err).__name__, type=type(err).__name__,
                        code=status.grpc.name)
    if isinstance(err, InvalidImage) and err.index is not None:
        error.index, error.id, error.reason = err.index, err.image_id, err.reason
    headers = {}
    if isinstance(err, ConnectionRefusal):
        headers["Connection"] = "close"
    if status.http in (429, 503):
        known = getattr(err, "retry_after_s", None)
        headers["Retry-After"] = str(RETRY_AFTER_S if known is None else max(1, math.ceil(known)))
    if status.http == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if status.http == 415:  # RFC 9110 15.5.16: the codings this door reads
        headers["Accept-Encoding"] = ", ".join(BODY_CODINGS)
    return _json(ErrorBody(error=error).model_dump(exclude_none=True), status.http, headers)


_INT64 = {FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64}


def model_json(info: pb.ModelInfo, created: int) -> dict:
    """The ModelInfo as JSON, as an entry of OpenAI's model list."""
    body = json_format.MessageToDict(info, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)
    body["config"] = json.loads(body.pop("config_json"))
    for part, message in ((body, info), (body["limits"], info.limits)):
        for field in message.DESCRIPTOR.fields:  # 64-bit integers are strings in proto JSON
            if field.cpp_type in _INT64 and isinstance(getattr(message, field.name), int):
                part[field.name] = getattr(message, field.name)
    body["outputs"] = [wire.kind_name(code) for code in info.outputs]
    body["dtypes"] = [wire.dtype_name(code) for code in info.dtypes]
    return {"id": info.model.name, "object": "model", "created": created, "owned_by": "vit22b",
            **body}


# ---- the door ------------------------------------------------------------------------------


# What a browser page may send and read across origins (with --http-cors-allow-origin).
CORS_HEADERS = ("Authorization", "Content-Type", "Content-Encoding", "Accept", "X-Request-Timeout",
                "traceparent", "tracestate")


class HttpDoor:
    def __init__(self, infer: Infer, metrics: Metrics, info: pb.ModelInfo, limits: ClientLimits,
                 tokens: Tokens | None = None, cors_origins: tuple[str, ...] = ()):
        self.infer, self.metrics, self.info, self.limits = infer, metrics, info, limits
        self.serving = False  # set by the server once every bucket is compiled
        tokens = tokens or Tokens(())
        self.guarded = bool(tokens)
        self.max_commas = (COMMAS_PER_IMAGE * infer.limits.max_request_images
                           + 2 * MAX_SPELLED + COMMAS_PER_IMAGE)
        self.models = {"object": "list", "data": [model_json(info, int(time.time()))]}
        self.app = self._app()
        self.asgi = _Guard(self.app, self, tokens, infer.limits.max_message_bytes, limits)
        if cors_origins:  # outside the guard: a preflight carries no token, and refusals
            # need the headers too, or the page cannot read why it was refused
            self.asgi = CORSMiddleware(self.asgi, allow_origins=cors_origins,
                                       allow_methods=("GET", "HEAD", "POST"),
                                       allow_headers=CORS_HEADERS, expose_headers=("Retry-After",))
        self._server: UvicornServer | None = None
        self._task: asyncio.Task | None = None

    def _app(self) -> FastAPI:
        # No redirect of '/v1/features/' to '/v1/features': a 307 with an empty body, to the
        # Host header the client sent; a 404 in the refusals' shape instead.
        app = FastAPI(title="vit22b", version=server_version(), description=__doc__,
                      redirect_slashes=False)
        app.add_exception_handler(StarletteHTTPException, _routing_error)
        app.add_api_route("/v1/embeddings", self.embeddings, methods=["POST"],
                          response_model=EmbeddingsResponse, summary="OpenAI-compatible embeddings")
        app.add_api_route("/v1/features", self.features, methods=["POST"],
                          response_model=FeaturesResponse, summary="Features (JSON or safetensors)")
        app.add_api_route("/v1/models", self.list_models, methods=["GET"],
                          response_model=ModelList, summary="Model info")
        app.add_api_route("/health", self.health, methods=["GET"], response_model=Liveness,
                          summary="Liveness")
        app.add_api_route("/ready", self.ready, methods=["GET"], response_model=Readiness,
                          summary="SERVING or not")
        for path, route in (("/health", self.health), ("/ready", self.ready),
                            ("/v1/models", self.list_models)):
            # HEAD too, as load balancers probe; out of the document (one operation per path)
            app.add_api_route(path, route, methods=["HEAD"], include_in_schema=False)
        bodies = {"/v1/embeddings": EmbeddingsRequest, "/v1/features": FeaturesRequest}

        def openapi() -> dict:  # the bodies are parsed in the routes, under their trace span
            if app.openapi_schema is None:
                schema = get_openapi(title=app.title, version=app.version,
                                     description=app.description, routes=app.routes)
                schemas = schema.setdefault("components", {}).setdefault("schemas", {})
                for model in (*bodies.values(), ErrorBody):
                    named = model.model_json_schema(ref_template="#/components/schemas/{model}")
                    schemas.update(named.pop("$defs", {}))
                    schemas[model.__name__] = named
                for path, model in bodies.items():
                    schema["paths"][path]["post"]["requestBody"] = {
                        "required": True, "content": {"application/json": {"schema": _ref(model)}}}
                features = schema["paths"]["/v1/features"]["post"]["responses"]["200"]
                features["content"][SAFETENSORS] = {"schema": {"type": "string",
                                                               "format": "binary"}}
                self._document_this_server(schemas)
                self._document_refusals(schema)
                app.openapi_schema = schema
            return app.openapi_schema

        app.openapi = openapi
        return app

    def _document_this_server(self, schemas: dict) -> None:
        """What this server accepts that the models cannot say: its model's name and its image
        count per request (a schema-driven tester sent an empty list and a model '' as valid)."""
        count = {"minItems": 1, "maxItems": self.infer.limits.max_request_images}
        schemas["FeaturesRequest"]["properties"]["images"].update(count)
        embeddings = schemas["EmbeddingsRequest"]["properties"]
        embeddings["model"]["enum"] = [self.info.model.name]
        for branch in embeddings["input"]["anyOf"]:
            if branch.get("type") == "array":
                branch.update(count)

    def _document_refusals(self, schema: dict) -> None:
        """Each operation's refusals in the document (code generators and schema-driven
        testers take undeclared statuses for defects), and the bearer scheme when tokens
        guard the server."""
        if self.guarded:
            schema["components"]["securitySchemes"] = {"bearer": {"type": "http",
                                                                  "scheme": "bearer"}}
        for path, operations in schema["paths"].items():
            for method, operation in operations.items():
                statuses = set(ANY_ROUTE)
                if method == "post":
                    statuses |= {s.http for s in STATUSES.values()} - {UNREAD}  # all described
                if path not in OPEN_PATHS:
                    statuses.add(401)
                    if self.guarded:
                        operation["security"] = [{"bearer": []}]
                for status in sorted(statuses):
                    body = _ref(ErrorBody)
                    if (path, status) == ("/ready", 503):  # NOT_SERVING is its own answer
                        body = {"anyOf": [body, {"type": "object", "properties": {
                            "status": {"type": "string", "enum": ["NOT_SERVING"]}}}]}
                    operation["responses"][str(status)] = {
                        "description": REFUSALS[status],
                        "content": {"application/json": {"schema": body}}}

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self, host: str, port: int, cert: str | None = None,
                    key: str | None = None) -> int:
        """Listen on ``host:port`` (0: a free port) in the running loop; the bound port."""
        sock = listen(host, port)
        # The connection class is named, not "auto" (httptools when installed, else h11): its
        # bounds hook httptools' parser callbacks. No WebSocket routes: an upgraded connection
        # would leave the class, and its bounds with it.
        config = uvicorn.Config(
            self.asgi, loop="none", lifespan="off", log_config=None, access_log=False,
            ssl_certfile=cert, ssl_keyfile=key, timeout_graceful_shutdown=5,
            http=BoundedConnection.bounded_by(self.limits, self.metrics.http_connections_ended,
                                              lambda err: error_response(err, status_of(err))),
            ws="none",
        )
        self._server = UvicornServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise OSError(f"the HTTP server on {host}:{port} did not start")
            await asyncio.sleep(0.005)
        return sock.getsockname()[1]

    async def stop(self) -> None:
        """Close the port and the idle connections (after the facade has drained)."""
        if self._server is not None:
            self._server.should_exit = True
            await self._task

    # ---- routes --------------------------------------------------------------------------
    async def health(self) -> Response:
        """Liveness: 503 once no batch can ever run again (a group that lost a process is never
        whole again: an orchestrator's liveness probe then restarts it); /ready says the rest."""
        try:
            self.infer.engine.executor.check()
        except NotReady as err:
            return error_response(err, status_of(err))
        return _json({"status": "ok"})

    async def ready(self) -> Response:
        serving = self.serving and not self.infer.draining.is_set()
        try:
            self.infer.engine.executor.check()
        except NotReady:
            serving = False
        if serving:
            return _json({"status": "SERVING"})
        return _json({"status": "NOT_SERVING"}, 503, {"Retry-After": str(RETRY_AFTER_S)})

    async def list_models(self, request: Request) -> Response:
        return await self._serve(f"{request.method} /v1/models", request, self._models)

    async def embeddings(self, request: Request) -> Response:
        return await self._serve("POST /v1/embeddings", request, self._embeddings)

    async def features(self, request: Request) -> Response:
        return await self._serve("POST /v1/features", request, self._features)

    async def _models(self, request: Request) -> Response:
        return _json(self.models)

    async def _embeddings(self, request: Request) -> Response:
        body = _parse(await self._json(request), EmbeddingsRequest, self.max_commas)
        name, width = self.info.model.name, self.info.pooled_dim or self.info.width
        if body.model != name:
            raise InvalidRequest(f"model {quoted(body.model)} is not served here; this server "
                                 f"serves {name!r} (GET /v1/models)")
        if body.dimensions is not None and body.dimensions != width:
            raise InvalidRequest(f"dimensions={body.dimensions} is not supported: {name}'s "
                                 f"embeddings have {width} (no truncation); omit dimensions")
        inputs = [body.input] if isinstance(body.input, str) else body.input
        self.infer.limits.check_images(len(inputs))
        call = EmbedCall([_image(text) for text in inputs], POOLED, l2_normalize=True,
                         deadline=_deadline(request))
        base64_out = body.encoding_format == "base64"
        result = await self._run(request, call, BASE64_RATIO if base64_out else FLOAT_TEXT_RATIO)
        rows = result.features.pooled
        if base64_out:
            vectors = [base64.b64encode(row.astype("<f4").tobytes()).decode() for row in rows]
        else:
            vectors = rows.tolist()
        tokens = len(inputs) * self.info.num_patches
        return _json({
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": v}
                     for i, v in zip(result.indices, vectors)],
            "model": name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        })

    async def _features(self, request: Request) -> Response:
        body = _parse(await self._json(request), FeaturesRequest, self.max_commas)
        self.infer.limits.check_images(len(body.images))
        call = EmbedCall(
            images=[_image(item) for item in body.images],
            outputs=OutputRequest.of(body.outputs, body.layers, body.normalize_patches),
            dtype=body.dtype,
            l2_normalize=body.l2_normalize,
            skip_invalid=body.skip_invalid,
            deadline=_deadline(request),
            geometry=Geometry(body.resolution, body.dense),
        )
        as_safetensors = _prefers_safetensors(request.headers.get("accept", ""))
        if as_safetensors:
            _check_safetensors_header([image.id for image in call.images])
            result = await self._run(request, call, 1.0, _safetensors_id_bytes)
        else:
            result = await self._run(request, call, BASE64_RATIO, _json_id_bytes)
        arrays, patches = self.infer.tensors(call, result, self.info)
        ref = json_format.MessageToDict(self.info.model, preserving_proto_field_name=True)
        ref["preprocess_hash"] = result.preprocess_hash or ref["preprocess_hash"]
        t = result.timings
        meta = {
            "model": ref,
            "ids": result.ids,
            "indices": result.indices,
            "grid": list(result.grid),
            "errors": [{"index": e.index, "id": e.image_id, "reason": e.reason}
                       for e in result.errors],
            "timings": {"queue_ms": t.queue_s * 1e3, "preprocess_ms": t.preprocess_s * 1e3,
                        "compute_ms": t.compute_s * 1e3, "total_ms": t.total_s * 1e3},
        }
        if as_safetensors:
            tensors = {**arrays, **{f"patch_tokens.{k}": v for k, v in patches.items()}}
            tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
            metadata = {k: json.dumps(v, separators=(",", ":"), ensure_ascii=False)
                        for k, v in meta.items()}
            return Response(safetensors.numpy.save(tensors, metadata), media_type=SAFETENSORS)
        outputs: dict = {k: _tensor(v) for k, v in arrays.items()}
        if patches:
            outputs["patch_tokens"] = {str(k): _tensor(v) for k, v in patches.items()}
        return _json({**meta, "outputs": outputs})

    # ---- bookkeeping ---------------------------------------------------------------------
    async def _json(self, request: Request) -> bytes:
        return json_body(dict(request.scope["headers"]), await request.body(),
                         self.infer.limits.max_message_bytes)

    async def _run(self, request: Request, call: EmbedCall, text_ratio: float,
                   id_bytes: Callable[[str], int] = _json_id_bytes) -> EmbedResult:
        """Validate, admit and run ``call``; its images are dropped if the client goes away or
        the deadline passes first. ``text_ratio``: the response's bytes per tensor byte;
        ``id_bytes``: an id's bytes in the response."""
        outputs = self.infer.validate(call)
        check_response_size(self.info, call, outputs, self.infer.limits.max_message_bytes,
                            text_ratio, id_bytes)
        admitted = await self.infer.admit(call, outputs)
        work = asyncio.ensure_future(self.infer.run(admitted))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            # Until the deadline by time.monotonic, as the batcher judges it: the loop's timers
            # run on its cached clock (uvloop reads it once per turn of the loop), so on a busy
            # loop the wait ended early and the dropped images counted as "cancelled". One wait
            # at least, even past the deadline: ``work`` must have started to give its admitted
            # room back when it is cancelled (a task cancelled before its first step runs none).
            while True:
                left = None if call.deadline is None else max(0.0, call.deadline - time.monotonic())
                done, _ = await asyncio.wait({work, gone}, timeout=left,
                                             return_when=asyncio.FIRST_COMPLETED)
                if done or not left:
                    break
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)  # its room given back
        if work in done:
            return work.result()
        if gone in done:
            raise CallerGone("the client disconnected; its images were not computed")
        raise DeadlineExpired("X-Request-Timeout passed before the images were computed")

    async def _serve(self, route: str, request: Request, work) -> Response:
        """One call: its trace span, refused while draining, counted, failures mapped."""
        tracing = self.infer.tracing
        with tracing.call(route, request.headers, **{"http.request.method": request.method,
                                                     "http.route": request.url.path}):
            try:
                self.infer.enter()
            except Draining as err:
                return self.refuse(route, err)
            try:
                response = await work(request)
            except Exception as err:  # noqa: BLE001 - mapped through the status table
                return self.refuse(route, err)
            finally:
                self.infer.leave()
        self.metrics.requests.labels(route, "OK").inc()
        return response

    def refuse(self, route: str, err: BaseException) -> Response:
        status = status_of(err)
        message = str(err) or type(err).__name__
        if status == INTERNAL:
            log.error("%s failed", route, exc_info=err)
        else:
            log.info("%s refused: %s %s: %s", route, status.http, status.grpc.name, message[:300])
        self.infer.tracing.failed(status, err)
        self.metrics.requests.labels(route, status.grpc.name).inc()
        return error_response(err, status)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Guard:
    """Before a route reads anything: the bearer token, then the body limit (``Content-Length``
    at once, else while the body arrives), its stall timeout and its rate floor; the body is
    handed on whole, so a route (and the facade's admission) starts only once it has all of it."""

    def __init__(self, app, door: HttpDoor, tokens: Tokens, limit: int,
                 clients: ClientLimits):
        self.app, self.door, self.tokens, self.limit = app, door, tokens, limit
        self.body_timeout_s, self.min_rate = clients.body_timeout_s, clients.min_body_rate

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[ARRIVED] = time.monotonic()
        path = scope["path"]
        route = f"{scope['method']} {path if path in ROUTES else '(other)'}"
        headers = dict(scope["headers"])
        refusal = None
        if self.tokens and path not in OPEN_PATHS:
            refusal = self.tokens.refusal(
                [value for key, value in scope["headers"] if key == b"authorization"],
                "header 'Authorization")
        if refusal is not None:
            return await self._unread(route, Unauthenticated(refusal))(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._unread(route, self._too_large(int(declared)))(
                scope, receive, send)
        chunks, size = [], 0
        first = last = time.monotonic()  # the first and the latest body bytes (headers: none yet)
        while True:
            stall, floor = last + self.body_timeout_s, self._floor(first, size)
            try:
                message = await asyncio.wait_for(receive(), min(stall, floor) - time.monotonic())
            except TimeoutError:  # a tie is the stall: nothing came for the whole timeout
                err = self._slow(first, size) if floor < stall else RequestTimeout(
                    f"no request body bytes for {self.body_timeout_s:g} s (--http-body-timeout)")
                return await self.door.refuse(route, err)(scope, receive, send)
            if message["type"] == "http.disconnect":  # counted, as gRPC's door counts it
                self.door.refuse(route, CallerGone("the client left while sending its body"))
                return None
            last = time.monotonic()
            if not chunks:
                first = last
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._unread(route, self._too_large(size))(scope, receive, send)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay():
            nonlocal whole
            if whole is None:
                return await receive()
            message, whole = whole, None
            return message

        return await self.app(scope, replay, send)

    def _unread(self, route: str, err: BaseException) -> Response:
        """A refusal before the body was read: the connection closes after it, since the
        rest of the body would otherwise be read as the next request (uvicorn drops it and
        keeps the client waiting for its keep-alive timeout)."""
        response = self.door.refuse(route, err)
        response.headers["Connection"] = "close"
        return response

    def _floor(self, first: float, size: int) -> float:
        """When the body's average rate falls under the floor with no more bytes: ``first +
        size / rate``, and never before its grace (``first + body_timeout_s``). Measured from
        the first body bytes, so a body that came with its headers and then stopped is a stall
        (both bounds end at once), not a slow body."""
        if not self.min_rate:
            return math.inf
        return first + max(self.body_timeout_s, size / self.min_rate)

    def _slow(self, first: float, size: int) -> RequestTimeout:
        elapsed = time.monotonic() - first
        return RequestTimeout(
            f"request body too slow: {size} bytes in {elapsed:.1f} s ({size / elapsed:.0f} "
            f"bytes/s), under the floor of {self.min_rate} bytes/s (--http-min-body-rate)")

    def _too_large(self, size: int) -> TooLarge:
        return TooLarge(f"request body of {size} bytes is over the message limit of "
                        f"{self.limit} bytes (--max-message-mb); send fewer images per request")
