"""The inference facade (TEI's ``Infer``): every door's one way into the model.

A call's life: ``validate`` (image count, outputs against the model, dtype; the executor's
health) -> ``admit`` (room in the queue: refused at once, or waited for by a stream) -> decode and
preprocess in the thread pool (the pixel contract, ``model/pixels.py``) -> ``submit`` to the
batcher -> await the features -> ``finish`` (L2, the output dtype, non-finite rows refused).
The doors (``service.py`` for gRPC, and any other) translate their wire format to an
``EmbedCall`` and the ``EmbedResult`` back, and map failures through ``status.py``.
``LocalInfer`` runs the same facade on a private event loop for in-process callers (the batch
job's local backend, the probes, the tests): one in-process path, the server's own.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from PIL.Image import Image as PILImage
from vit22b.model.errors import (
    Draining,
    InvalidImage,
    InvalidRequest,
    NonFiniteOutput,
    QueueFull,
    quoted,
)
from vit22b.model.features import Features
from vit22b.model.outputs import POOLED, OutputRequest
from vit22b.model.pixels import (
    DEFAULT_MAX_IMAGE_PIXELS,
    OWN_GEOMETRY,
    Geometry,
    Preprocessor,
    check_pixels,
    decode,
    decode_opened,
    open_encoded,
    plain_jpeg,
)
from vit22b.v1 import features_pb2 as pb
from vit22b.v1 import wire

from .batcher import Batcher, ended_by_deadline
from .engine import Engine
from .handoff import Handoff
from .metrics import Metrics
from .settings import ServeConfig
from .tracing import Tracing

_ADMIT_POLL_S = (0.001, 0.05)  # a waiting stream retries admission with this backoff range
# Finishing (L2, the cast, the finiteness check) runs on the event loop below this size and in
# the preprocessing pool above it: measured here, 1 MiB takes ~0.3 ms and 16 MiB ~8 ms, which
# would stall every other call on the loop; a pool round trip costs ~35 us.
INLINE_FINISH_BYTES = 1 << 20
# A call's one image this small (declared pixels, and encoded bytes) decodes in the handoff
# worker (server/handoff.py): a round trip to the preprocessing pool cost the event loop more
# than decoding it, and decoding it on the loop held up every other call (benchmarks/NOTES.md,
# "fifth pass" and "ninth pass"). Larger ones decode in the pool, side by side.
SMALL_DECODE_PIXELS = 128 * 128
SMALL_DECODE_BYTES = 64 << 10
DRAIN_RESEND = "server is shutting down; resend the requests not answered"  # to a stream
DRAIN_RETRY = "server is shutting down; retry on another replica"  # to a call


def served_resolutions(listed: tuple[int, ...], own: int) -> tuple[int, ...]:
    """The square sizes served: those ``--resolutions`` lists and the model's own, always (the
    geometry of every request that names none, compiled at start-up and described by
    ``GetModelInfo``), in ascending order."""
    return tuple(sorted({own, *listed}))


@dataclass(frozen=True)
class Limits:
    # defaults: `vit22b serve`'s (an in-process facade's, and tests')
    max_request_images: int = ServeConfig.max_request_images
    max_message_bytes: int = int(ServeConfig.max_message_mb * (1 << 20))
    max_image_pixels: int = ServeConfig.max_image_pixels
    resolutions: tuple[int, ...] = ()  # square sizes served besides the model's own
    max_dense_patches: int = 0  # dense requests' patch bound (0: dense mode off)

    def check_images(self, count: int) -> None:
        """A request's image count: at least one, at most ``max_request_images``. The doors
        call this before they read images one by one (a gRPC message of 30 million empty
        images took 100 s of the event loop to read before the count was checked)."""
        if count == 0:
            raise InvalidRequest("no images in the request")
        if count > self.max_request_images:
            raise InvalidRequest(
                f"{count} images in one request exceed the limit of {self.max_request_images}; "
                "split it into several requests (the client SDK does) or stream them"
            )


@dataclass(frozen=True)
class ImageInput:
    """One image as a door received it: encoded file bytes or raw uint8 [H, W, 3] pixels.

    ``error``: the door could not read the image's data (its reason); it counts as invalid."""

    data: bytes | np.ndarray | None
    id: str = ""
    error: str = ""


@dataclass(frozen=True)
class EmbedCall:
    images: Sequence[ImageInput]
    outputs: OutputRequest = POOLED  # as asked; resolved against the model here
    dtype: str = "float32"
    l2_normalize: bool = False
    skip_invalid: bool = False  # invalid images become errors beside the others' features
    deadline: float | None = None  # time.monotonic()
    wait_for_room: bool = False  # wait for queue room (a stream) instead of QueueFull
    streamed: bool = False  # a stream's message: its reader admits the next ones meanwhile
    solo: bool = False  # batches of this call alone (bit-exact batch jobs)
    geometry: Geometry = OWN_GEOMETRY  # the square size, or dense (model/pixels.py)


@dataclass
class Timings:
    preprocess_s: float = 0.0
    queue_s: float = 0.0
    compute_s: float = 0.0
    total_s: float = 0.0


@dataclass
class EmbedResult:
    """Rows of ``indices`` (positions in the call), in the call's output dtype."""

    outputs: OutputRequest  # resolved
    features: Features
    ids: list[str] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    errors: list[InvalidImage] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    grid: tuple[int, int] = (0, 0)  # the images' patch grid (rows, cols)
    preprocess_hash: str = ""  # the contract at the call's geometry


@dataclass
class Admitted:
    """A validated call holding its room in the queue."""

    call: EmbedCall
    outputs: OutputRequest
    start: float
    held: int  # admitted images this call still has to give back


class Infer:
    def __init__(
        self,
        engine: Engine,
        batcher: Batcher,
        metrics: Metrics,
        limits: Limits,
        preprocess_threads: int,
        tracing: Tracing | None = None,
    ):
        self.engine, self.batcher, self.metrics, self.limits = engine, batcher, metrics, limits
        self.tracing = tracing or Tracing()
        self._pool = ThreadPoolExecutor(preprocess_threads, thread_name_prefix="vit22b-preprocess")
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.draining = asyncio.Event()
        self._preprocessors: dict[Geometry, Preprocessor] = {}  # by the geometry asked for
        self._handoff = Handoff("vit22b-decode")
        self.small_decode_pixels = SMALL_DECODE_PIXELS  # 0: always the pool (A/B switch)

    # ---- lifecycle (shared by every door) ------------------------------------------------
    def enter(self) -> None:
        """A call starts; refused while draining."""
        if self.draining.is_set():
            raise Draining(DRAIN_RETRY)
        self._inflight += 1
        self._idle.clear()

    def leave(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    async def drain(self, timeout: float | None) -> bool:
        """Refuse new calls, let accepted ones finish; False if ``timeout`` passed first."""
        self.draining.set()
        self.batcher.flush()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        self._handoff.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- one call ------------------------------------------------------------------------
    def validate(self, call: EmbedCall) -> OutputRequest:
        """Request-level checks, before any image is decoded; the resolved outputs."""
        self.engine.executor.check()
        self.limits.check_images(len(call.images))
        if call.dtype not in wire.OUTPUT_DTYPES:
            raise InvalidRequest(f"unknown output dtype {quoted(call.dtype)}; known: "
                                 f"{', '.join(wire.OUTPUT_DTYPES)}")
        self.preprocessor(call.geometry)  # the geometry must be one this server serves
        outputs = self.engine.resolve(call.outputs)
        if call.l2_normalize and not outputs.pooled:
            raise InvalidRequest(
                "l2_normalize applies to pooled features, which were not requested"
            )
        self.engine.admit_outputs(outputs, reserve=False)  # its place once an image decodes
        return outputs

    @property
    def resolutions(self) -> tuple[int, ...]:
        return served_resolutions(self.limits.resolutions, self.engine.cfg.image_size)

    def preprocessor(self, geometry: Geometry) -> Preprocessor:
        """The pixel contract at an allowed geometry; InvalidRequest naming what is allowed."""
        if (served := self._preprocessors.get(geometry)) is not None:  # twice per call
            return served
        cfg = self.engine.cfg
        resolution = geometry.resolution or cfg.image_size
        allowed = ", ".join(map(str, self.resolutions))
        if resolution not in self.resolutions:
            raise InvalidRequest(
                f"resolution {resolution} is not served; allowed: {allowed} (the server's "
                "--resolutions)"
            )
        if geometry.dense and not self.limits.max_dense_patches:
            raise InvalidRequest(
                f"dense mode is off on this server (--max-dense-patches 0); square resolutions "
                f"allowed: {allowed}"
            )
        key = Geometry(resolution, geometry.dense,
                       self.limits.max_dense_patches if geometry.dense else 0)
        self._preprocessors[geometry] = Preprocessor(cfg, key)  # a few per allowed size
        return self._preprocessors[geometry]

    async def admit(self, call: EmbedCall, outputs: OutputRequest) -> Admitted:
        """Room in the queue for the call's images: at once, or (``wait_for_room``) as it
        drains, until the deadline."""
        start, n = time.monotonic(), len(call.images)
        with self.tracing.step("admission", images=n):
            await self._room(call, n)
        return Admitted(call, outputs, start, n)

    async def _room(self, call: EmbedCall, n: int) -> None:
        if not call.wait_for_room or n > self.batcher.max_queue_images:
            self.batcher.admit(n)
            return
        pause = _ADMIT_POLL_S[0]
        while not self.batcher.try_admit(n):
            if self.draining.is_set():
                raise Draining(DRAIN_RESEND)
            left = None if call.deadline is None else call.deadline - time.monotonic()
            if left is not None and left <= pause:
                self.metrics.images.labels("rejected").inc(n)
                raise QueueFull(
                    "queue full until the call's deadline: the server is over capacity; "
                    "retry with backoff or give the stream a longer deadline"
                )
            await asyncio.sleep(pause)
            pause = min(pause * 2, _ADMIT_POLL_S[1])

    def abandon(self, admitted: Admitted) -> None:
        """Give back the room an admitted call still holds, its images counted as dropped
        (expired, or cancelled): a call gone while its images were decoded, or before its
        ``run`` started; after a ``run`` it holds none."""
        if admitted.held:
            expired = ended_by_deadline(admitted.call.deadline, time.monotonic())
            self.metrics.images.labels("expired" if expired else "cancelled").inc(admitted.held)
            self.batcher.release(admitted.held)
            admitted.held = 0

    async def run(self, admitted: Admitted) -> EmbedResult:
        """Decode, batch, compute and finish an admitted call."""
        call, start = admitted.call, admitted.start
        begun = time.monotonic()  # preprocessing from here: a stream's wait for room is not in it
        try:
            pre = self.preprocessor(call.geometry)
            with self.tracing.step("preprocess", images=len(call.images)):
                pixels, indices, errors = await self._preprocess(call, pre)
            preprocessed = time.monotonic()
            self.metrics.preprocess_seconds.observe(preprocessed - begun)
            self.batcher.release(admitted.held - len(indices))
            admitted.held = len(indices)
            result = EmbedResult(admitted.outputs, Features(), errors=errors)
            if indices:
                self.engine.admit_outputs(admitted.outputs)
                job = self.batcher.submit(pixels, admitted.outputs, call.deadline, call.solo)
                admitted.held = 0  # the batcher accounts for queued rows from here on
                try:
                    done = await job.future
                except asyncio.CancelledError:
                    self.batcher.withdraw(job)
                    raise
                finally:
                    self.tracing.job(job)
                result.features = done.features
                result.timings.queue_s, result.timings.compute_s = done.queue_s, done.compute_s
        except asyncio.CancelledError:  # gone (or out of time) while its images were decoded
            self.abandon(admitted)
            raise
        finally:
            if admitted.held:
                self.batcher.release(admitted.held)
                admitted.held = 0
        result.ids = [call.images[i].id for i in indices]
        result.indices = indices
        result.preprocess_hash = pre.hash
        if pixels is not None:
            result.grid = self.engine.cfg.grid_at(*pixels.shape[1:3])
        result.timings.preprocess_s = preprocessed - begun
        if result.features.nbytes > INLINE_FINISH_BYTES:  # large: keep the event loop free
            await asyncio.get_running_loop().run_in_executor(
                self._pool, self._finish, call, result
            )
        else:
            self._finish(call, result)
        result.timings.total_s = time.monotonic() - start
        return result

    async def embed(self, call: EmbedCall) -> EmbedResult:
        """The whole call: validate, admit, run."""
        return await self.run(await self.admit(call, self.validate(call)))

    def tensors(
        self, call: EmbedCall, result: EmbedResult, info: pb.ModelInfo
    ) -> tuple[dict[str, np.ndarray], dict[int, np.ndarray]]:
        """A result's arrays by name, and its patch tokens by layer as the call spelled them;
        with no image computed (every one refused under skip_invalid), each output asked for
        with no rows, so a caller reads the same keys whatever was refused."""
        if not result.indices:
            g = call.geometry
            return wire.empty_outputs(info, call.outputs.kinds, call.outputs.patch_layers,
                                      call.dtype, wire.patches_at(info, g.resolution, g.dense))
        depth, features = self.engine.cfg.depth, result.features
        patches = {layer: features.patch_tokens[layer % depth]
                   for layer in call.outputs.patch_layers}
        return dict(features.arrays()), patches

    # ---- steps -----------------------------------------------------------------------------
    async def _preprocess(self, call: EmbedCall, pre: Preprocessor):
        if len(call.images) == 1:
            try:
                results = [await self._load_one(call.images[0], pre)]
            except InvalidImage as err:
                results = [err]
        else:
            loop = asyncio.get_running_loop()
            tasks = [
                loop.run_in_executor(self._pool, self._load, i, image, pre)
                for i, image in enumerate(call.images)
            ]
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
            if not call.skip_invalid:
                first = errors[0]
                more = f" (and {len(errors) - 1} more invalid images)" if len(errors) > 1 else ""
                raise InvalidImage(first.reason + more, first.index, first.image_id)
        sizes = {image.shape[:2] for image in good}
        if len(sizes) > 1:
            p = self.engine.cfg.patch
            grids = ", ".join(f"image {i}: {h // p}x{w // p}" for i, (h, w) in
                              zip(indices, (image.shape[:2] for image in good)))
            raise InvalidRequest(
                f"dense mode gives these images different patch grids ({grids}); a request "
                "holds one grid: send images of one aspect ratio together, or one per request"
            )
        if len(good) == 1:  # a view: the batcher copies it into the batch
            return good[0][None], indices, errors
        return (np.stack(good) if good else None), indices, errors

    async def _load_one(self, image: ImageInput, pre: Preprocessor) -> np.ndarray:
        """A call's one image: a small one in the handoff worker, others in the pool.

        The worker parses the header and sends an image that is larger than its bytes said on
        to the pool; the loop only awaits. Off the loop either way, so it admits the calls
        behind this one meanwhile and the batcher sees their images coming."""
        if self.small_decode_pixels and self._small_bytes(image):
            loaded = await self._handoff.submit(self._load_if_small, image, pre)
            if not isinstance(loaded, Future):
                return loaded
            return await asyncio.wrap_future(loaded)
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, self._load, 0, image, pre)

    @staticmethod
    def _small_bytes(image: ImageInput) -> bool:
        data = image.data
        if isinstance(data, np.ndarray):
            return True  # its size is checked in the worker (``_small``)
        return isinstance(data, (bytes, bytearray, memoryview)) and (
            len(data) <= SMALL_DECODE_BYTES)

    def _load_if_small(self, image: ImageInput, pre: Preprocessor) -> np.ndarray | Future:
        """In the handoff worker: a small image decoded, or the pool's future for a larger
        one (its parsed header passed on)."""
        try:
            here, opened = self._small(image)
        except InvalidImage as err:
            raise err.at(0, image.id) from None
        if here:
            return self._load(0, image, pre, opened)
        return self._pool.submit(self._load, 0, image, pre, opened)

    def _small(self, image: ImageInput) -> tuple[bool, PILImage | None]:
        """Whether an image is small enough for the handoff worker (``SMALL_DECODE_*``), and
        the header of encoded bytes when it was parsed to tell."""
        data, limit = image.data, self.small_decode_pixels
        if image.error or not limit or not self._small_bytes(image):
            return False, None
        if isinstance(data, np.ndarray):
            return data.size <= 3 * limit, None
        if (plain := plain_jpeg(data)) is not None:  # its size without Pillow's header parser
            return plain[0] * plain[1] <= limit, None
        opened = open_encoded(bytes(data), self.limits.max_image_pixels)
        return opened.width * opened.height <= limit, opened

    def _load(self, index: int, image: ImageInput, pre: Preprocessor,
              opened: PILImage | None = None) -> np.ndarray:
        """One image -> model input, in the preprocessing pool or the handoff worker;
        ``opened``: its header, parsed already by ``_small``."""
        try:
            if image.error:
                raise InvalidImage(image.error)
            if opened is not None:
                pixels = decode_opened(opened, self.limits.max_image_pixels, pre.min_side)
            elif isinstance(image.data, (bytes, bytearray, memoryview)):
                pixels = decode(bytes(image.data), self.limits.max_image_pixels,
                                pre.min_side)
            elif isinstance(image.data, np.ndarray):
                pixels = check_pixels(image.data, self.limits.max_image_pixels)
            else:
                raise InvalidImage("no image data: send encoded file bytes or raw pixels")
            return pre.crop(pixels)  # uint8 levels: the compiled forward normalises them
        except InvalidImage as err:
            raise err.at(index, image.id) from None

    def _finish(self, call: EmbedCall, result: EmbedResult) -> None:
        """L2, the output dtype, and refusal of rows that are not finite in it."""
        if not result.indices:
            return
        dtype = wire.numpy_dtype(call.dtype)
        features = result.features.finish(call.l2_normalize)
        features = features if dtype == np.float32 else features.astype(dtype)
        bad = features.non_finite_rows()
        if len(bad):
            self.metrics.images.labels("non_finite").inc(len(bad))
            hint = " (float16 overflows beyond 65504: ask for float32 or bfloat16)" if (
                call.dtype == "float16"
            ) else ""
            reason = f"the forward produced NaN or Inf in its {call.dtype} outputs{hint}"
            refused = [InvalidImage(reason, result.indices[r], result.ids[r]) for r in bad]
            if not call.skip_invalid:
                more = f" (and {len(bad) - 1} more images)" if len(bad) > 1 else ""
                raise NonFiniteOutput(f"{refused[0]}{more}")
            keep = np.setdiff1d(np.arange(len(features)), bad)
            features = features.take(keep)
            result.ids = [result.ids[r] for r in keep]
            result.indices = [result.indices[r] for r in keep]
            result.errors = sorted(result.errors + refused, key=lambda e: e.index)
        result.features = features


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The loop the doors and ``LocalInfer`` run on: uvloop's where installed (its loop and
    thread wake-ups are C; measured here 4-8% more single-image calls per second than
    asyncio's, benchmarks/NOTES.md), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run_loop(coroutine):
    """``asyncio.run`` on ``new_event_loop()``."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coroutine)


class LocalInfer:
    """The facade on a private event loop: the in-process path for jobs, probes and tests.

    Calls larger than a batch are cut into batches, two in flight (one decodes while the other
    computes); ``solo`` keeps each batch by itself so results do not depend on what else runs.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        preprocess_threads: int = 2,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        resolutions: tuple[int, ...] = (),
        max_dense_patches: int = 0,
    ):
        """``resolutions`` / ``max_dense_patches``: the geometries served (see ``Limits``)."""
        self.engine = engine
        self.metrics = Metrics()
        self.batcher = Batcher(engine, self.metrics, max_delay_s=0.0,
                               max_queue_images=4 * engine.max_batch_images)
        limits = Limits(max_request_images=engine.max_batch_images,
                        max_image_pixels=max_image_pixels, resolutions=tuple(resolutions),
                        max_dense_patches=max_dense_patches)
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="vit22b-local-infer")
        self._thread.start()
        self.infer = self._call(self._make(limits, preprocess_threads))
        self.batcher.start()

    async def _make(self, limits: Limits, threads: int) -> Infer:
        return Infer(self.engine, self.batcher, self.metrics, limits, threads)

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def embed(
        self,
        images: Sequence[bytes | np.ndarray | ImageInput],
        outputs: OutputRequest = POOLED,
        *,
        dtype: str = "float32",
        l2_normalize: bool = False,
        skip_invalid: bool = False,
        solo: bool = False,
        geometry: Geometry = OWN_GEOMETRY,
    ) -> EmbedResult:
        """Encoded bytes or raw uint8 [H, W, 3] images -> features, in order (float32 default).

        Invalid images raise ``InvalidImage`` naming the image, unless ``skip_invalid``."""
        inputs = [im if isinstance(im, ImageInput) else ImageInput(im) for im in images]
        if not inputs:
            raise InvalidRequest("no images to embed")
        step = self.engine.max_batch_images
        calls = [
            EmbedCall(inputs[i : i + step], outputs, dtype, l2_normalize, skip_invalid,
                      wait_for_room=True, solo=solo, geometry=geometry)
            for i in range(0, len(inputs), step)
        ]
        return _merge(self._call(self._embed_all(calls, step)), step)

    async def _embed_all(self, calls: list[EmbedCall], step: int) -> list[EmbedResult]:
        window = asyncio.Semaphore(2)

        async def one(offset: int, call: EmbedCall) -> EmbedResult:
            async with window:
                try:
                    return await self.infer.embed(call)
                except InvalidImage as err:  # named by its place in the caller's list
                    raise err.shifted(offset) from None

        return await asyncio.gather(*(one(k * step, call) for k, call in enumerate(calls)))

    def close(self) -> None:
        self.batcher.stop()
        self.infer.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> LocalInfer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _merge(parts: list[EmbedResult], step: int) -> EmbedResult:
    """Per-batch results -> one, with indices and errors in the caller's positions."""
    merged = EmbedResult(parts[0].outputs, Features(),
                         preprocess_hash=parts[0].preprocess_hash)
    with_rows = [p.features for p in parts if p.indices]
    if with_rows:
        merged.features = Features.concat(with_rows)
    for k, part in enumerate(parts):
        offset = k * step
        merged.ids += part.ids
        merged.indices += [offset + i for i in part.indices]
        merged.errors += [e.shifted(offset) for e in part.errors]
        if part.indices:
            if merged.grid not in ((0, 0), part.grid):
                raise InvalidRequest(
                    f"dense mode gives these images different patch grids ({merged.grid} and "
                    f"{part.grid}); embed images of one aspect ratio together"
                )
            merged.grid = part.grid
        for name in ("preprocess_s", "queue_s", "compute_s", "total_s"):
            setattr(merged.timings, name,
                    getattr(merged.timings, name) + getattr(part.timings, name))
    return merged
