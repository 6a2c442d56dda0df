"""The FeatureService handlers: validation, preprocessing off the event loop, error mapping.

A thin transport layer over the engine and the batcher. Each call: parse and validate the
request (INVALID_ARGUMENT naming what is wrong), admit its images (RESOURCE_EXHAUSTED at once
when the queue is full), decode and preprocess them in a thread pool (overlapping the compute
thread), queue them, and turn the features into wire tensors in the requested dtype.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np
from vit22b.model import OutputRequest
from vit22b.model.errors import Draining, InvalidImage, InvalidRequest
from vit22b.model.pixels import check_pixels, decode
from vit22b.v1 import features_pb2 as pb
from vit22b.v1 import features_pb2_grpc as pb_grpc
from vit22b.v1 import wire

from .batcher import Batcher
from .engine import Engine, Features, finish
from .metrics import Metrics
from .status import status_code

log = logging.getLogger(__name__)

SERVER_VERSION = "vit22b 0.1.0"


@dataclass(frozen=True)
class Limits:
    max_request_images: int = 256
    max_message_bytes: int = 64 << 20
    max_image_pixels: int = 40_000_000


@dataclass(frozen=True)
class Plan:
    """A validated request: what to compute and how to return it."""

    kinds: tuple[str, ...]
    layers: tuple[int, ...]  # patch-token layers as requested (deduplicated, in order)
    outputs: OutputRequest  # resolved, for the engine
    dtype: str
    l2_normalize: bool
    skip_invalid: bool


def plan_request(
    request: pb.EmbedRequest, engine: Engine, info: pb.ModelInfo, limits: Limits
) -> Plan:
    n = len(request.images)
    if n == 0:
        raise InvalidRequest("no images in the request")
    if n > limits.max_request_images:
        raise InvalidRequest(
            f"{n} images in one request exceed the limit of {limits.max_request_images}; "
            "split it into several requests (the client SDK does) or use EmbedStream"
        )
    kinds = [wire.kind_name(code) for code in request.outputs] or ["pooled"]
    layers = tuple(dict.fromkeys(request.patch_layers))
    if layers and "patch_tokens" not in kinds:
        kinds.append("patch_tokens")
    if "patch_tokens" in kinds and not layers:
        layers = (-1,)
    kinds = tuple(k for k in wire.OUTPUT_KINDS if k in kinds)
    outputs = engine.resolve(
        OutputRequest(
            pooled="pooled" in kinds,
            class_token="class_token" in kinds,
            patch_layers=layers,
            attention_stats="attention_stats" in kinds,
            norm_patches=request.normalize_patches,
            logits="logits" in kinds,
        )
    )
    dtype = wire.output_dtype(request.dtype)
    if request.l2_normalize and "pooled" not in kinds:
        raise InvalidRequest("l2_normalize applies to pooled features, which were not requested")
    row = wire.row_bytes(info, list(kinds), list(layers), dtype)
    size = wire.response_bytes(row, [image.id for image in request.images])
    if size > limits.max_message_bytes:
        raise InvalidRequest(
            f"the response for {n} images would be about {size >> 20} MiB, over the message "
            f"limit of {limits.max_message_bytes >> 20} MiB; send fewer images per request"
        )
    return Plan(kinds, layers, outputs, dtype, request.l2_normalize, request.skip_invalid_images)


def model_info(engine: Engine, batcher: Batcher, limits: Limits) -> pb.ModelInfo:
    cfg, ident = engine.cfg, engine.identity
    kinds = ["attention_stats"]
    kinds += ["patch_tokens"]
    if cfg.head != "none":
        kinds.insert(0, "pooled")
    if cfg.class_token:
        kinds.append("class_token")
    if cfg.num_classes:
        kinds.append("logits")
    p = cfg.preprocess
    return pb.ModelInfo(
        model=model_ref(engine),
        source=ident.source,
        config_json=json.dumps(cfg.to_dict(), sort_keys=True),
        parameter_count=engine.parameter_count,
        width=cfg.width,
        depth=cfg.depth,
        heads=cfg.heads,
        num_patches=cfg.num_patches,
        num_classes=cfg.num_classes,
        outputs=[wire.kind_code(k) for k in wire.OUTPUT_KINDS if k in kinds],
        dtypes=[wire.dtype_code(d) for d in wire.OUTPUT_DTYPES],
        preprocessing=pb.Preprocessing(
            image_size=cfg.image_size,
            resize=p.resize,
            interpolation=p.interpolation,
            mean=p.mean,
            std=p.std,
            hash=ident.preprocess_hash,
            description=engine.preprocess.describe(),
        ),
        mesh=pb.Mesh(
            spec=engine.mesh_spec,
            axes=dict(engine.mesh.shape),
            platform=engine.mesh.devices.flat[0].platform,
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
        ),
        server_version=SERVER_VERSION,
    )


def model_ref(engine: Engine) -> pb.ModelRef:
    ident = engine.identity
    return pb.ModelRef(
        name=ident.name, fingerprint=ident.fingerprint, preprocess_hash=ident.preprocess_hash
    )


class FeatureService(pb_grpc.FeatureServiceServicer):
    def __init__(
        self,
        engine: Engine,
        batcher: Batcher,
        metrics: Metrics,
        limits: Limits,
        preprocess_threads: int,
        stream_window: int = 8,
    ):
        self.engine, self.batcher, self.metrics, self.limits = engine, batcher, metrics, limits
        self.info = model_info(engine, batcher, limits)
        self._pool = ThreadPoolExecutor(preprocess_threads, thread_name_prefix="vit22b-preprocess")
        self._stream_window = stream_window
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = asyncio.Event()

    # ---- lifecycle ---------------------------------------------------------------------------
    async def drain(self, timeout: float | None) -> bool:
        """Refuse new calls, let accepted ones finish; False if ``timeout`` passed first."""
        self._draining.set()
        self.batcher.flush()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _enter(self) -> None:
        if self._draining.is_set():
            raise Draining("server is shutting down; retry on another replica")
        self._inflight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    async def _abort(self, method: str, context, err: Exception) -> None:
        code = status_code(err)
        if code == grpc.StatusCode.INTERNAL:
            log.error("%s failed", method, exc_info=err)
        self.metrics.requests.labels(method, code.name).inc()
        await context.abort(code, str(err) or type(err).__name__)

    # ---- handlers ----------------------------------------------------------------------------
    async def GetModelInfo(self, request, context):
        self.metrics.requests.labels("GetModelInfo", "OK").inc()
        return self.info

    @contextlib.asynccontextmanager
    async def _call(self, method: str, context):
        """One call's bookkeeping: refuse while draining, count it, map failures to codes."""
        try:
            self._enter()
        except Draining as err:
            await self._abort(method, context, err)
        try:
            yield
        except asyncio.CancelledError:
            self.metrics.requests.labels(method, "CANCELLED").inc()
            raise
        except Exception as err:  # noqa: BLE001 - mapped through the status table
            await self._abort(method, context, err)
        finally:
            self._leave()
        self.metrics.requests.labels(method, "OK").inc()

    async def Embed(self, request, context):
        async with self._call("Embed", context):
            return await self._embed(request, context)

    async def EmbedStream(self, request_iterator, context) -> AsyncIterator[pb.EmbedResponse]:
        async with self._call("EmbedStream", context):
            order: asyncio.Queue = asyncio.Queue(self._stream_window)
            reader = asyncio.create_task(self._read_stream(request_iterator, context, order))
            try:
                while True:
                    item = await order.get()
                    if item is None:
                        break
                    if isinstance(item, Exception):
                        raise item
                    yield await item
            finally:
                reader.cancel()
                while not order.empty():
                    item = order.get_nowait()
                    if isinstance(item, asyncio.Task):
                        item.cancel()

    async def _read_stream(self, request_iterator, context, order: asyncio.Queue) -> None:
        """Start each incoming request at once; queue its task so responses keep request order."""
        requests = request_iterator.__aiter__()
        drained = asyncio.create_task(self._draining.wait())
        try:
            while True:
                incoming = asyncio.ensure_future(requests.__anext__())
                await asyncio.wait({incoming, drained}, return_when=asyncio.FIRST_COMPLETED)
                if not incoming.done():
                    incoming.cancel()
                    await order.put(
                        Draining("server is shutting down; resend the requests not answered")
                    )
                    return
                try:
                    request = incoming.result()
                except StopAsyncIteration:
                    await order.put(None)
                    return
                await order.put(asyncio.create_task(self._embed(request, context)))
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - a transport error ends the stream
            await order.put(err)
        finally:
            drained.cancel()

    # ---- one request -------------------------------------------------------------------------
    async def _embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        start = time.monotonic()
        remaining = context.time_remaining()
        deadline = None if remaining is None else start + remaining
        plan = plan_request(request, self.engine, self.info, self.limits)
        n = len(request.images)
        self.batcher.admit(n)
        admitted = n  # admitted images this call still has to give back
        try:
            pixels, indices, errors = await self._preprocess(request.images, plan.skip_invalid)
            preprocessed = time.monotonic()
            self.metrics.preprocess_seconds.observe(preprocessed - start)
            self.batcher.release(admitted - len(indices))
            admitted = len(indices)
            features, queue_s, compute_s = {}, 0.0, 0.0
            if indices:
                job = self.batcher.submit(pixels, plan.outputs, deadline)
                admitted = 0  # the batcher accounts for queued rows from here on
                try:
                    result = await asyncio.wrap_future(job.future)
                except asyncio.CancelledError:
                    job.cancel()
                    raise
                features, queue_s, compute_s = result.features, result.queue_s, result.compute_s
        except asyncio.CancelledError:  # gone (or out of time) while its images were decoded
            if admitted:
                expired = deadline is not None and time.monotonic() >= deadline
                self.metrics.images.labels("expired" if expired else "cancelled").inc(admitted)
            raise
        finally:
            if admitted:
                self.batcher.release(admitted)
        ids = [request.images[i].id for i in indices]
        timings = pb.Timings(
            queue_ms=queue_s * 1e3,
            preprocess_ms=(preprocessed - start) * 1e3,
            compute_ms=compute_s * 1e3,
            total_ms=(time.monotonic() - start) * 1e3,
        )
        return self._response(
            plan, finish(features, plan.l2_normalize), ids, indices, errors, timings
        )

    async def _preprocess(self, images, skip_invalid: bool):
        loop = asyncio.get_running_loop()
        tasks = [loop.run_in_executor(self._pool, self._load, i, im) for i, im in enumerate(images)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        good, indices, errors = [], [], []
        for i, result in enumerate(results):
            if isinstance(result, InvalidImage):
                errors.append(result)
            elif isinstance(result, BaseException):
                raise result
            else:
                good.append(result)
                indices.append(i)
        if errors:
            self.metrics.images.labels("invalid").inc(len(errors))
            if not skip_invalid:
                more = f" (and {len(errors) - 1} more invalid images)" if len(errors) > 1 else ""
                raise InvalidImage(errors[0].reason + more, errors[0].index, errors[0].image_id)
        pixels = np.stack(good) if good else None
        return (
            pixels,
            indices,
            [pb.ImageError(index=e.index, id=e.image_id, reason=e.reason) for e in errors],
        )

    def _load(self, index: int, image: pb.Image) -> np.ndarray:
        """One image -> model input; runs in the preprocessing pool."""
        try:
            source = image.WhichOneof("source")
            if source == "encoded":
                pixels = decode(image.encoded, self.limits.max_image_pixels)
            elif source == "pixels":
                if image.pixels.dtype != pb.DTYPE_UINT8:
                    raise InvalidImage(
                        f"raw pixels must be uint8, got dtype {_dtype_label(image.pixels.dtype)}"
                    )
                try:
                    array = wire.from_tensor(image.pixels, copy=False)
                except wire.WireError as err:
                    raise InvalidImage(f"raw pixels: {err}") from None
                pixels = check_pixels(array, self.limits.max_image_pixels)
            else:
                raise InvalidImage("no image data: set `encoded` (file bytes) or `pixels`")
            return self.engine.preprocess(pixels)
        except InvalidImage as err:
            raise err.at(index, image.id) from None

    def _response(self, plan: Plan, features: Features, ids, indices, errors, timings):
        response = pb.EmbedResponse(
            model=self.info.model, ids=ids, indices=indices, errors=errors, timings=timings
        )
        if not indices:
            return response
        for name in wire.TENSOR_FIELDS:
            if name in features:
                getattr(response, name).CopyFrom(wire.to_tensor(features[name], plan.dtype))
        depth = self.engine.cfg.depth
        for layer in plan.layers:
            tokens = features["patch_tokens"][layer % depth]
            response.patch_tokens[layer].CopyFrom(wire.to_tensor(tokens, plan.dtype))
        return response


def _dtype_label(code: int) -> str:
    try:
        return wire.dtype_name(code)
    except wire.WireError:
        return f"code {code} (unknown)"
