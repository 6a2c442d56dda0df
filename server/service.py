"""The gRPC door: proto <-> ``EmbedCall`` translation and status mapping over the facade.

Bodies arrive as raw bytes and are parsed here, after the token check (an unauthenticated call
is refused before its body is read) and with a clear INVALID_ARGUMENT for bytes that are not a
message. A stream admits each request before it reads the next one: while the queue is full it
stops reading (HTTP/2 flow control then holds the sender) and goes on as the queue drains; only a
deadline that passes while it waits ends it with RESOURCE_EXHAUSTED. Refused calls are logged
in one line each at INFO; only INTERNAL (a bug) logs a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import grpc
from google.protobuf.message import DecodeError
from vit22b.model.errors import Draining, InvalidImage, InvalidRequest, TooLarge
from vit22b.model.outputs import OutputRequest, check_listed
from vit22b.model.pixels import OWN_GEOMETRY, Geometry, check_pixel_shape
from vit22b.v1 import features_pb2 as pb
from vit22b.v1 import wire

from .batcher import DEADLINE_SLACK_S
from .infer import DRAIN_RESEND, Admitted, EmbedCall, EmbedResult, ImageInput, Infer, Limits
from .metrics import Metrics
from .parsing import MessageWaits, NoMessage
from .status import refuse, status_of
from .unread import Unread

log = logging.getLogger(__name__)

SERVICE_NAME = "vit22b.v1.FeatureService"
# grpc.health.v1 names: "" and the service's own say whether calls are served now (readiness:
# NOT_SERVING while draining or a group is broken); LIVENESS whether they ever can be again (a
# group that lost a process cannot), for a liveness probe, as the HTTP door's /health
READINESS = ("", SERVICE_NAME)
LIVENESS = "liveness"
STREAM_WINDOW = 8  # requests of one stream admitted and not yet answered


def server_version() -> str:
    try:
        return f"vit22b {version('vit22b')}"
    except PackageNotFoundError:  # running from a source tree
        return "vit22b (not installed)"


def parse(raw: bytes, message: type):
    """Request bytes -> message, or INVALID_ARGUMENT naming the message type."""
    try:
        return message.FromString(raw)
    except (DecodeError, RuntimeWarning, ValueError) as err:
        name = message.DESCRIPTOR.full_name
        raise InvalidRequest(f"request body is not a {name}: {err}") from None


def to_call(request: pb.EmbedRequest, context, limits: Limits, streamed: bool = False
            ) -> EmbedCall:
    limits.check_images(len(request.images))
    remaining = context.time_remaining()
    check_listed("outputs", request.outputs)
    kinds = [wire.kind_name(code) for code in request.outputs]
    return EmbedCall(
        images=[image_input(image) for image in request.images],
        outputs=OutputRequest.of(kinds, request.patch_layers, request.normalize_patches),
        dtype=wire.output_dtype(request.dtype),
        l2_normalize=request.l2_normalize,
        skip_invalid=request.skip_invalid_images,
        deadline=None if remaining is None else time.monotonic() + remaining,
        wait_for_room=streamed,
        streamed=streamed,
        geometry=_geometry(request),
    )


def _geometry(request: pb.EmbedRequest) -> Geometry:
    if request.resolution < 0:
        raise InvalidRequest(f"resolution {request.resolution} is negative")
    return Geometry(request.resolution, request.dense)


def image_input(image: pb.Image) -> ImageInput:
    """An ``Image`` message as the facade's input; what cannot be read becomes its error."""
    source = image.WhichOneof("source")
    if source == "encoded":
        return ImageInput(image.encoded, image.id)
    if source == "pixels":
        if image.pixels.dtype != pb.DTYPE_UINT8:
            return ImageInput(None, image.id, f"raw pixels must be uint8, got dtype "
                                              f"{_dtype_label(image.pixels.dtype)}")
        try:
            check_pixel_shape(image.pixels.shape)  # before its bytes: [] needs 1 byte
            return ImageInput(wire.from_tensor(image.pixels, copy=False), image.id)
        except InvalidImage as err:
            return ImageInput(None, image.id, err.reason)
        except wire.WireError as err:
            return ImageInput(None, image.id, f"raw pixels: {err}")
    return ImageInput(None, image.id, "no image data: set `encoded` (file bytes) or `pixels`")


def _dtype_label(code: int) -> str:
    if code == pb.DTYPE_UNSPECIFIED:
        return "DTYPE_UNSPECIFIED (unset: raw pixels are DTYPE_UINT8)"
    try:
        return wire.dtype_name(code)
    except wire.WireError:
        return f"code {code} (unknown)"


def model_info(infer: Infer) -> pb.ModelInfo:
    engine, batcher, limits = infer.engine, infer.batcher, infer.limits
    cfg, ident = engine.cfg, engine.identity
    p = cfg.preprocess
    return pb.ModelInfo(
        model=wire.model_ref(ident),
        source=ident.source,
        config_json=json.dumps(cfg.to_dict(), sort_keys=True),
        parameter_count=engine.parameter_count,
        width=cfg.width,
        depth=cfg.depth,
        heads=cfg.heads,
        num_patches=cfg.num_patches,
        num_classes=cfg.num_classes,
        outputs=[wire.kind_code(k) for k in ident.outputs],
        dtypes=[wire.dtype_code(d) for d in wire.OUTPUT_DTYPES],
        preprocessing=pb.Preprocessing(
            image_size=cfg.image_size,
            resize=p.resize,
            interpolation=p.interpolation,
            mean=p.mean,
            std=p.std,
            hash=ident.preprocess_hash,
            description=infer.preprocessor(OWN_GEOMETRY).describe(),
        ),
        mesh=pb.Mesh(
            spec=engine.mesh_spec,
            axes=dict(engine.mesh.shape),
            platform=engine.platform,
            num_devices=engine.mesh.size,
        ),
        limits=pb.Limits(
            max_batch_images=batcher.max_batch_images,
            batch_buckets=engine.buckets,
            max_delay_ms=batcher.max_delay_s * 1000.0,
            max_queue_images=batcher.max_queue_images,
            max_request_images=limits.max_request_images,
            max_message_bytes=limits.max_message_bytes,
            max_image_pixels=limits.max_image_pixels,
            max_batch_patches=engine.plan.max_batch_patches,
            resolutions=infer.resolutions,
            max_dense_patches=limits.max_dense_patches,
        ),
        server_version=server_version(),
        pooled_dim=cfg.pooled_dim,
        num_registers=cfg.num_registers,
    )


@dataclass
class _Owed:
    """A stream's answers admitted and not yet sent: while any is, its client may be waiting
    for them before it sends more, so the wait for its next request is not timed."""

    count: int = 0


class FeatureService:
    def __init__(self, infer: Infer, metrics: Metrics, unread: Unread, waits: MessageWaits):
        self.infer, self.metrics, self.unread, self.waits = infer, metrics, unread, waits
        self.info = model_info(infer)

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's methods, taking raw request bytes (parsed in the handlers); the unary
        ones read their message themselves (``MessageWaits.only_message``)."""
        serialize = {
            "Embed": pb.EmbedResponse.SerializeToString,
            "EmbedStream": pb.EmbedResponse.SerializeToString,
            "GetModelInfo": pb.ModelInfo.SerializeToString,
        }
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Embed": grpc.stream_unary_rpc_method_handler(
                    self.Embed, response_serializer=serialize["Embed"]
                ),
                "EmbedStream": grpc.stream_stream_rpc_method_handler(
                    self.EmbedStream, response_serializer=serialize["EmbedStream"]
                ),
                "GetModelInfo": grpc.stream_unary_rpc_method_handler(
                    self.GetModelInfo, response_serializer=serialize["GetModelInfo"]
                ),
            },
        )

    # ---- bookkeeping ---------------------------------------------------------------------
    async def _abort(self, method: str, context, err: Exception) -> None:
        status = status_of(err)
        code = status.grpc
        self.infer.tracing.failed(status, err)
        message = str(err) or type(err).__name__
        if code == grpc.StatusCode.INTERNAL:
            log.error("%s failed", method, exc_info=err)
        # the image at fault, as its request (or stream message) lists it: a client that split
        # its input into requests names it by the caller's own index (``wire.IMAGE_INDEX``)
        trailing = ((wire.IMAGE_INDEX, str(err.index)),) if isinstance(err, InvalidImage) and (
            err.index is not None) else ()
        try:
            await refuse(context, code, message, trailing)
        except asyncio.CancelledError:  # gRPC had ended the call: logged and counted as that
            code, message = ended_by_grpc(context, err)
            raise
        finally:
            if code != grpc.StatusCode.INTERNAL:
                log.info("%s refused: %s: %s", method, code.name, message[:300])
            self.metrics.requests.labels(method, code.name).inc()

    @contextlib.asynccontextmanager
    async def _call(self, method: str, context):
        """One call: its trace span, refuse while draining, count it, map failures through the
        status table."""
        with self.infer.tracing.call(f"{SERVICE_NAME}/{method}", context.invocation_metadata,
                                     **{"rpc.system": "grpc", "rpc.method": method}):
            try:
                self.infer.enter()
            except Draining as err:
                await self._abort(method, context, err)
            try:
                yield
            # gRPC ended the call: cancelled in an await, or (a session suspended at its
            # ``yield`` while its answer was sent) closed there
            except (asyncio.CancelledError, GeneratorExit):
                code, _ = ended_by_grpc(context)
                self.metrics.requests.labels(method, code.name).inc()
                raise
            except Exception as err:  # noqa: BLE001 - mapped through the status table
                await self._abort(method, context, err)
            finally:
                self.infer.leave()
            self.metrics.requests.labels(method, "OK").inc()

    # ---- handlers ------------------------------------------------------------------------
    async def GetModelInfo(self, requests, context):
        async with self._call("GetModelInfo", context):
            parse(await self.waits.only_message(context, "GetModelInfo"), pb.GetModelInfoRequest)
            return self.info

    async def Embed(self, requests, context):
        async with self._call("Embed", context):
            peer = context.peer()
            self.unread.check(peer)  # before the body is read
            raw = await self.waits.only_message(context, "Embed")
            call = to_call(parse(raw, pb.EmbedRequest), context, self.infer.limits)
            outputs = self.infer.validate(call)
            # the answer counts from its admission until its call ends (sent, refused, gone)
            context.add_done_callback(self.unread.reserve(self._check_size(call, outputs), peer))
            result = await self.infer.run(await self.infer.admit(call, outputs))
            return self._response(call, result)

    async def EmbedStream(self, requests, context) -> AsyncIterator[pb.EmbedResponse]:
        async with self._call("EmbedStream", context):
            order: asyncio.Queue = asyncio.Queue(STREAM_WINDOW)
            owed = _Owed()
            reader = asyncio.create_task(self._read_stream(requests, context, order, owed))
            item = None
            try:
                while True:
                    item = await order.get()
                    if item is None:
                        break
                    if isinstance(item, Exception):
                        raise item
                    task, release = item
                    response = await task
                    item = None
                    try:
                        yield response  # resumes once gRPC has sent it
                    finally:
                        release()
                    owed.count -= 1
                    if not owed.count:  # the client may have waited for it: time its next
                        self.waits.start_clock(reader)
            finally:
                if isinstance(item, tuple):  # the stream ended as its answer came
                    _discard(*item)
                reader.cancel()
                _settle(reader)
                while not order.empty():
                    item = order.get_nowait()
                    if isinstance(item, tuple):
                        _discard(*item)

    async def _read_stream(self, requests, context, order: asyncio.Queue, owed: _Owed) -> None:
        """Admit each request before reading the next; queue its task (responses in order).

        The wait for a next request is bounded (``MessageWaits``) once no answer is owed, and
        ended by a drain."""
        peer = context.peer()
        try:
            messages = aiter(requests)
            while True:
                raw = await self.waits.next_message(messages, "EmbedStream", held=owed.count > 0)
                if raw is None:
                    await order.put(None)
                    return
                if self.infer.draining.is_set():
                    raise Draining(DRAIN_RESEND)
                call = to_call(parse(raw, pb.EmbedRequest), context, self.infer.limits,
                               streamed=True)
                outputs = self.infer.validate(call)
                # its answer counts from here until sent or discarded (stream answers wait in
                # the window while earlier ones are sent)
                release = self.unread.reserve(self._check_size(call, outputs), peer)
                try:
                    admitted = await self.infer.admit(call, outputs)
                except BaseException:
                    release()
                    raise
                task = self._answer_task(call, admitted)
                owed.count += 1
                try:
                    await order.put((task, release))
                except asyncio.CancelledError:  # the stream ended while the window was full:
                    _discard(task, release)  # nobody will await this answer
                    raise
        except Exception as err:  # noqa: BLE001 - a refused request or transport error ends it
            await order.put(err)

    def _answer_task(self, call: EmbedCall, admitted: Admitted) -> asyncio.Task:
        """A stream's answer as a task. One cancelled before its first step (the stream ended in
        the loop's pass that queued it) never runs ``Infer.run``, whose ``finally`` gives the
        call's room in the queue back: its done callback does."""
        task = asyncio.create_task(self._answer(call, admitted))
        task.add_done_callback(lambda _: self.infer.abandon(admitted))
        return task

    async def _answer(self, call: EmbedCall, admitted: Admitted) -> pb.EmbedResponse:
        return self._response(call, await self.infer.run(admitted))

    # ---- translation ---------------------------------------------------------------------
    def _check_size(self, call: EmbedCall, outputs: OutputRequest) -> int:
        return check_response_size(self.info, call, outputs,
                                   self.infer.limits.max_message_bytes)

    def _response(self, call: EmbedCall, result: EmbedResult) -> pb.EmbedResponse:
        t = result.timings
        model = pb.ModelRef()
        model.CopyFrom(self.info.model)
        model.preprocess_hash = result.preprocess_hash or model.preprocess_hash
        response = pb.EmbedResponse(
            model=model,
            ids=result.ids,
            indices=result.indices,
            errors=[pb.ImageError(index=e.index, id=e.image_id, reason=e.reason)
                    for e in result.errors],
            timings=pb.Timings(queue_ms=t.queue_s * 1e3, preprocess_ms=t.preprocess_s * 1e3,
                               compute_ms=t.compute_s * 1e3, total_ms=t.total_s * 1e3),
        )
        arrays, patches = self.infer.tensors(call, result, self.info)
        if result.indices:
            response.grid_rows, response.grid_cols = result.grid
        for name, array in arrays.items():
            getattr(response, name).CopyFrom(wire.to_tensor(array))
        for layer, tokens in patches.items():
            response.patch_tokens[layer].CopyFrom(wire.to_tensor(tokens))
        return response


def check_response_size(
    info: pb.ModelInfo, call: EmbedCall, outputs: OutputRequest, limit: int,
    text_ratio: float = 1.0, id_bytes: Callable[[str], int] = wire.utf8_bytes,
) -> int:
    """The call's response's size in bytes (at most: every image answered), or ``TooLarge``
    when it would not fit the message limit. ``text_ratio``:
    the bytes the response's encoding spends per tensor byte (1 for protobuf and safetensors;
    more for JSON, which carries tensors as base64 or numbers); ``id_bytes``: an id's bytes as
    the encoding writes it (JSON escapes)."""
    layers = list(call.outputs.patch_layers)
    g = call.geometry
    patches = wire.patches_at(info, g.resolution, g.dense)
    row = wire.row_bytes(info, list(outputs.kinds), layers, call.dtype, patches)
    row = math.ceil(row * text_ratio)
    size = wire.response_bytes(row, [image.id for image in call.images], id_bytes)
    if size > limit:
        raise TooLarge(
            f"the response for {len(call.images)} images would be about {size} bytes, over "
            f"the message limit of {limit} bytes (--max-message-mb); send fewer images per "
            "request"
        )
    return size


def ended_by_grpc(context, err: Exception | None = None) -> tuple[grpc.StatusCode, str]:
    """The status gRPC itself gave a call that ended before its handler answered (the handler
    is told only that it ended): DEADLINE_EXCEEDED once its deadline has passed (or nearly:
    ``DEADLINE_SLACK_S``, the client's own deadline being the earlier);
    RESOURCE_EXHAUSTED when the handler read no message (``err``: ``NoMessage``), since gRPC
    refuses a message over the receive limit before the handler sees it (a client that leaves
    before its message is whole reads the same: the handler cannot tell the two apart, and
    says both); else CANCELLED, the client gone."""
    left = context.time_remaining()
    if left is not None and left <= DEADLINE_SLACK_S:
        return grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed"
    if isinstance(err, NoMessage):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, (
            "the call ended before its request message arrived whole: over the message limit "
            "(--max-message-mb, refused by gRPC), or the client left while sending it")
    return grpc.StatusCode.CANCELLED, "the client cancelled the call"


def _discard(task: asyncio.Task, release: Callable[[], None]) -> None:
    """A stream's answer nobody will send: its task cancelled, its count released."""
    task.cancel()
    _settle(task)
    release()


def _settle(task: asyncio.Future) -> None:
    """Retrieve a finished task's outcome so asyncio does not log it as never retrieved."""
    if task.done() and not task.cancelled():
        task.exception()
    elif not task.done():
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
