"""The synchronous client SDK, and what it shares with the async one.

``FeatureClient(address | [addresses], token=..., tls=...)``; ``embed(images, outputs=...)``
returns numpy arrays per requested output. Inputs are split into requests that fit the server's
limits (images per request and message size, learnt from GetModelInfo), sent ``concurrency`` at
a time round-robin over the addresses, retried with exponential backoff on UNAVAILABLE and
RESOURCE_EXHAUSTED. Never imports jax.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import numbers
import os
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import grpc
import numpy as np
from vit22b.model.errors import InvalidImage, is_number
from vit22b.model.outputs import OutputRequest, listed
from vit22b.v1 import features_pb2 as pb
from vit22b.v1 import features_pb2_grpc as pb_grpc
from vit22b.v1 import wire

from .embeddings import Embeddings, ImageError, from_response, merge
from .inputs import Item, as_images, items, to_proto

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class FeatureError(RuntimeError):
    """A call the server refused or failed; ``code`` is the gRPC status code; ``index``: the
    caller's index of the image at fault, when one was (the message names it the same)."""

    def __init__(self, code: grpc.StatusCode, details: str, first_index: int = 0, count: int = 0,
                 in_request: int | None = None):
        self.code, self.details, self.first_index = code, details, first_index
        self.index = None if in_request is None else first_index + in_request
        named, where = f"image {in_request}", ""
        if self.index is not None and details.startswith((f"{named} ", f"{named}:")):
            details = f"image {self.index}{details[len(named):]}"
        elif count:
            where = f" (request of images {first_index}..{first_index + count - 1})"
        super().__init__(f"{code.name}: {details}{where}")


@dataclass(frozen=True)
class Retry:
    """Exponential backoff with jitter on UNAVAILABLE and RESOURCE_EXHAUSTED."""

    attempts: int = 6  # tries per request, the first included
    initial_s: float = 0.1
    max_s: float = 5.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        check_count("attempts", self.attempts, default_none=False)
        for name, low in (("initial_s", 0.0), ("max_s", self.initial_s), ("multiplier", 1.0)):
            value = getattr(self, name)  # a wait of -1, NaN or inf fails only when it is due
            if not (is_number(value) and math.isfinite(value) and value >= low):
                raise ValueError(f"Retry.{name} must be a finite number >= {low}, got {value!r}")

    def delay(self, attempt: int) -> float:
        base = min(self.max_s, self.initial_s * self.multiplier**attempt)
        return base * random.uniform(0.5, 1.0)

    def should_retry(self, err: grpc.RpcError, attempt: int) -> bool:
        if attempt + 1 >= self.attempts or err.code() not in RETRYABLE:
            return False
        # gRPC's message-size check also says RESOURCE_EXHAUSTED; resending cannot help.
        return "larger than max" not in (err.details() or "")


@dataclass(frozen=True)
class EmbedOptions:
    """What to ask for (validated locally, before anything is sent)."""

    outputs: tuple[str, ...] = ("pooled",)
    layers: tuple[int, ...] = ()
    dtype: str = "float32"
    l2_normalize: bool = False
    normalize_patches: bool = False
    skip_invalid: bool = False
    resolution: int = 0  # the square input size (0: the model's own)
    dense: bool = False  # aspect ratio kept, no crop (one image per request: one grid each)

    def __post_init__(self) -> None:
        OutputRequest.of(self.outputs, self.layers)  # raises on an unknown kind or layer
        r = self.resolution
        if not (is_number(r, numbers.Integral) and 0 <= r < 2**31):
            raise ValueError(f"resolution must be an integer >= 0, got {r!r}")
        if self.dtype is not None and not isinstance(self.dtype, str):  # np.float16, ...
            with contextlib.suppress(TypeError):  # (np.dtype(None) is float64: not a choice)
                object.__setattr__(self, "dtype", np.dtype(self.dtype).name)
        if self.dtype not in wire.OUTPUT_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {wire.OUTPUT_DTYPES}")
        for name in ("l2_normalize", "normalize_patches", "skip_invalid", "dense"):
            flag = getattr(self, name)  # "no" or None would pass as a truth value
            if not (isinstance(flag, np.bool_) or (
                    isinstance(flag, numbers.Integral) and flag in (0, 1))):  # bool included
                raise ValueError(f"{name} must be True or False, got {flag!r}")

    # Spelled once per options (an instance is shared by the calls that pass the same
    # keywords: see ``options_of``), not on every request.
    @cached_property
    def asked(self) -> OutputRequest:
        """The output request these options spell (defaults: model/outputs.py)."""
        return OutputRequest.of(self.outputs, self.layers, self.normalize_patches)

    @cached_property
    def kinds(self) -> tuple[str, ...]:
        return self.asked.kinds

    @cached_property
    def patch_layers(self) -> tuple[int, ...]:
        return self.asked.patch_layers

    @cached_property
    def _template(self) -> pb.EmbedRequest:
        """A request of no images with these options: copied per request (half the cost of
        spelling its fields again)."""
        return pb.EmbedRequest(
            outputs=[wire.kind_code(k) for k in self.kinds],
            patch_layers=self.patch_layers,
            dtype=wire.dtype_code(self.dtype),
            l2_normalize=self.l2_normalize,
            normalize_patches=self.normalize_patches,
            skip_invalid_images=self.skip_invalid,
            resolution=self.resolution,
            dense=self.dense,
        )

    def request(self, images: Sequence[pb.Image]) -> pb.EmbedRequest:
        request = pb.EmbedRequest()
        request.CopyFrom(self._template)
        request.images.extend(images)
        return request


@lru_cache(maxsize=64)
def _options_of(spelling: tuple) -> EmbedOptions:
    return EmbedOptions(**{k: v for k, _, v in spelling})


def options_of(options: dict) -> EmbedOptions:
    """``embed``'s keywords as ``EmbedOptions``: the same keywords give the same (cached)
    instance; an invalid set raises, and is not cached."""
    # Each value's type is in the key: 1 == True and 224 == 224.0, but they are not the same
    # keywords (a float resolution must fail as it would uncached).
    lists = {"outputs": str, "layers": numbers.Integral}  # a list, one item, or None
    spelling = tuple(sorted(
        (k, type(v), tuple(listed(v, lists[k])) if k in lists else v)
        for k, v in options.items()))
    try:
        hash(spelling)
    except TypeError:  # e.g. an unhashable layer: checked anew, to the same error
        return EmbedOptions(**{k: v for k, _, v in spelling})
    return _options_of(spelling)



def chunk_items(
    stream: Iterable[Item], info: pb.ModelInfo, options: EmbedOptions, batch_size: int | None
) -> Iterator[list[Item]]:
    """Group inputs into requests within the server's image-count and message-size limits.

    Request and response sizes are counted as the server counts them (``wire.response_bytes``).
    """
    limits = info.limits
    per_request = min(batch_size or limits.max_batch_images, limits.max_request_images)
    if options.dense:  # each image's own grid: one per request
        per_request = 1
    row = wire.row_bytes(info, options.kinds, options.patch_layers, options.dtype,
                         wire.patches_at(info, options.resolution, options.dense))
    budget = limits.max_message_bytes - wire.MESSAGE_SLACK
    chunk: list[Item] = []
    sent = answered = 0  # bytes of the chunk's request and of its response
    for item in stream:
        overhead = wire.image_overhead(item.id)
        if item.size + overhead > budget or row + overhead > budget:
            what = "its bytes" if item.size + overhead > budget else f"its outputs ({row} bytes)"
            err = InvalidImage(
                f"{what} exceed the server's message limit of {limits.max_message_bytes} bytes",
                item.index,
                item.id,
            )
            if not options.skip_invalid:
                raise err
            item = item._replace(image=err, size=0)  # sent as nothing: its request's error
        full = len(chunk) == per_request
        if chunk and (
            full or sent + item.size + overhead > budget or answered + row + overhead > budget
        ):
            yield chunk
            chunk, sent, answered = [], 0, 0
        chunk.append(item)
        sent += item.size + overhead
        answered += row + overhead
    if chunk:
        yield chunk


def build_request(chunk: list[Item], options: EmbedOptions):
    """The request for one chunk, the caller's index of each image sent, and local errors.

    With ``skip_invalid``, unreadable local inputs become errors instead of raising.
    """
    images, sent, errors = [], [], []
    for item in chunk:
        try:
            images.append(to_proto(item))
            sent.append(item.index)
        except InvalidImage as err:
            if not options.skip_invalid:
                raise
            errors.append(ImageError(err.index, err.image_id, err.reason))
    return options.request(images), sent, errors


def nothing_sent(info: pb.ModelInfo, options: EmbedOptions,
                 errors: list[ImageError]) -> Embeddings:
    """A chunk none of whose images could be sent: its outputs with no rows, as the server
    answers a request whose every image it refused."""
    arrays, patches = wire.empty_outputs(
        info, options.kinds, options.patch_layers, options.dtype,
        wire.patches_at(info, options.resolution, options.dense))
    return Embeddings(**arrays, patch_tokens=patches, errors=errors)


def chunk_result(
    response: pb.EmbedResponse, sent: list[int], local_errors: list[ImageError]
) -> Embeddings:
    """One response with the caller's indices (local inputs may have been skipped)."""
    result = from_response(response, sent)
    if result.errors or local_errors:
        result.errors = sorted(result.errors + local_errors, key=lambda e: e.index)
    return result


def start_embed(images, ids, info: pb.ModelInfo, progress: bool, batch_size: int | None, **options):
    """Options, the lazy stream of request chunks, and the progress bar (or None)."""
    batch_size = check_count("batch_size", batch_size)
    options = options_of(options)
    images = as_images(images)
    chunks = chunk_items(items(images, ids), info, options, batch_size)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        total = len(images) if hasattr(images, "__len__") else None
        bar = tqdm(total=total, unit="img", desc="embed")
    return options, chunks, bar


MAX_TIMEOUT_S = 1e8  # about three years: a longer timeout, inf included, means no limit in practice


def check_timeout(timeout) -> float | None:
    """A timeout as given (seconds; None: the default), checked: a positive number, at most
    ``MAX_TIMEOUT_S`` (gRPC's deadlines and the event loop's timers overflow beyond it)."""
    if timeout is None:
        return None
    if not is_number(timeout):
        raise TypeError(f"timeout must be a number of seconds or None, not "
                        f"{type(timeout).__name__}")
    if not timeout > 0:  # NaN too
        raise ValueError(f"timeout must be more than 0 seconds, got {timeout}")
    return min(float(timeout), MAX_TIMEOUT_S)


def check_count(name: str, value, default_none: bool = True) -> int | None:
    """A count the caller sets (``batch_size``, ``concurrency``): an int of at least 1, or None
    where ``default_none`` (the default then applies)."""
    if value is None and default_none:
        return None
    if not is_number(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return int(value)


CLOSED = "the client is closed"
CLOSED_IN_FLIGHT = "the client was closed while the call was in flight"


class _InGrpc:
    """How many of this process's threads are in a gRPC call of the SDK's now, a session's
    open stream counting one (its reader waits in gRPC until it ends)."""

    def __init__(self) -> None:
        self._lock, self.count = threading.Lock(), 0

    def __enter__(self) -> None:
        with self._lock:
            self.count += 1

    def __exit__(self, *exc) -> None:
        with self._lock:
            self.count -= 1


_IN_GRPC = _InGrpc()
# Clients and sessions of this process: a child made by fork takes each up afresh (its
# ``_after_fork``), and keeps the parent's channels and streams in ``_INHERITED``, never used,
# closed or collected there.
_LIVE: weakref.WeakSet = weakref.WeakSet()
_INHERITED: list = []
# gRPC runs its fork handlers only when no thread is in a call: otherwise a child's gRPC is a
# copy taken mid-call, where a call on an inherited channel hung past its deadline and new
# channels' calls crashed the child (SIGABRT in the epoll poller) in up to half the pools tried.
# Such a child refuses every call at once (``check_fork``).
_AT_FORK = 0  # the SDK's threads in gRPC calls as this process forks (read in the child)
_FORKED_MID_CALL = 0  # in a child: its parent's, or an ancestor's, at the fork


def _before_fork() -> None:
    global _AT_FORK
    _AT_FORK = _IN_GRPC.count  # exact: the other threads cannot change it without the GIL


def _after_fork_in_child() -> None:
    global _FORKED_MID_CALL
    _FORKED_MID_CALL = _FORKED_MID_CALL or _AT_FORK
    _IN_GRPC.__init__()  # its lock may have been held by a thread left in the parent
    for live in list(_LIVE):
        live._after_fork()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)

FORKED_MID_CALL = "this process was forked while its parent was in a gRPC call"


def check_fork() -> None:
    """Refuses a call in a child forked while the parent was in a gRPC call (see above)."""
    if _FORKED_MID_CALL:
        raise RuntimeError(
            f"{FORKED_MID_CALL} of this SDK ({_FORKED_MID_CALL} at the fork; an open session "
            "counts one): gRPC's state here is a copy taken mid-call, where calls hang or crash "
            "the process, a new client's too. Close the parent's sessions and let its calls "
            "end before forking (before a DataLoader's workers start, say), or start the "
            "workers with spawn or forkserver (multiprocessing.get_context('spawn'), "
            "DataLoader(multiprocessing_context='spawn'))")


class ClientBase:
    """What both clients share: addresses, credentials, token, channel options, retries.

    ``address`` may be a list: requests are spread round-robin and retried on the next one.
    ``tls``: True (system roots) or a PEM file of trusted roots. ``token``: bearer token.
    ``timeout``: seconds per request (None: no limit; see ``check_timeout``); a call's own
    ``timeout`` replaces it. ``concurrency``: requests in flight per ``embed``.
    """

    _grpc = grpc  # the channel module: grpc, or grpc.aio for the async client

    def __init__(
        self,
        address: str | Sequence[str] = "127.0.0.1:50051",
        *,
        token: str | None = None,
        tls: bool | str | os.PathLike = False,
        timeout: float | None = 120.0,
        retry: Retry | None = None,
        concurrency: int = 4,
    ):
        if not isinstance(address, (str, Iterable)):
            raise TypeError(f"address must be 'host:port' or a list of them, not "
                            f"{type(address).__name__}")
        self.addresses = [address] if isinstance(address, str) else list(address)
        if not self.addresses:
            raise ValueError("no server address given")
        for a in self.addresses:
            if not isinstance(a, str) or not a.strip():
                raise ValueError(f"a server address is 'host:port', got {a!r}")
        if token is not None and not (isinstance(token, str) and token.isprintable()
                                      and token.isascii()):
            # gRPC would refuse the metadata at every call, in its own words
            raise ValueError("token must be a string of printable ASCII characters")
        if token is not None and not token.strip():  # an unset variable, say: no token sent
            raise ValueError("token is empty (for no token, leave it out or pass None)")
        if retry is not None and not isinstance(retry, Retry):
            raise TypeError(f"retry must be a Retry, not {type(retry).__name__}")
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.timeout = check_timeout(timeout)
        self.retry = retry or Retry()
        self.closed = False
        self.concurrency = check_count("concurrency", concurrency, default_none=False)
        # The roots are read here: a bad path fails now, not at the first call.
        roots = None if tls is True or not tls else Path(tls).read_bytes()
        if roots is not None and b"-----BEGIN CERTIFICATE-----" not in roots:
            # a key or a DER file failed at the first call, as a handshake gRPC cannot make
            raise ValueError(f"tls={os.fspath(tls)!r} holds no PEM certificate: give the trusted "
                             "roots (or the server's own certificate) as PEM")
        self._tls, self._roots = bool(tls), roots
        self._info: pb.ModelInfo | None = None
        self._per_process()

    def _per_process(self) -> None:
        """What a client holds of this process alone: its channels (opened by its first call),
        the round-robin's counter and lock. Made anew in a child made by fork (``_after_fork``:
        no gRPC call there) and where a client is unpickled."""
        self._channels: list = []
        self._stubs: list = []
        self._next = itertools.count()
        self._lock = threading.Lock()
        _LIVE.add(self)

    def _after_fork(self) -> None:
        """In a child made by fork: the parent's channels are left as they are, neither used,
        closed nor collected (a grpc.aio channel collected there spun for ever); this
        process's own are opened at its first call, and its lock is free (another of the
        parent's threads may have held it)."""
        _INHERITED.append(self.__dict__.copy())
        self._per_process()

    def __getstate__(self) -> dict:
        """A client pickles as its settings (its token included): a worker process started
        by spawn or forkserver, a DataLoader's dataset holding it, opens its own channels."""
        state = self.__dict__.copy()
        for name in ("_channels", "_stubs", "_next", "_lock", "_loop"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._per_process()

    def _open(self) -> None:
        """A channel (and its stub) per address."""
        # No client-side caps: requests are sized to the server's limits, which rule. A
        # connection of its own per client: gRPC shares one between the channels of a process
        # to one address, so another client's forgotten sessions (a stream each, up to the
        # server's per-connection bound) would block this client's calls too.
        options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1),
                   ("grpc.use_local_subchannel_pool", 1)]
        if self._tls:
            credentials = grpc.ssl_channel_credentials(self._roots)
            self._channels = [self._grpc.secure_channel(a, credentials, options)
                              for a in self.addresses]
        else:
            self._channels = [self._grpc.insecure_channel(a, options) for a in self.addresses]
        self._stubs = [pb_grpc.FeatureServiceStub(c) for c in self._channels]

    def _timeout(self, timeout: float | None) -> float | None:
        """A call's timeout: its own, checked, or the client's."""
        return self.timeout if timeout is None else check_timeout(timeout)

    def _pick(self, method: str):
        """Round-robin: each call (and each retry) goes to the next address."""
        if self.closed:  # gRPC's own words for it differ by client kind and are not public
            raise RuntimeError(CLOSED)
        check_fork()
        with self._lock:
            if not self._stubs:  # its first call in this process
                self._open()
            return getattr(self._stubs[next(self._next) % len(self._stubs)], method)

    def _backoff(self, err: grpc.RpcError, attempt: int, first: int, count: int) -> float:
        """Seconds to wait before retrying ``err``; raises ``FeatureError`` when not to retry."""
        if self.closed:  # the channel closed under the call
            raise RuntimeError(CLOSED_IN_FLIGHT) from None
        if not self.retry.should_retry(err, attempt):
            raise FeatureError(err.code(), err.details() or "", first, count,
                               _image_index(err)) from None
        return self.retry.delay(attempt)


class _Calls:
    """The gRPC calls of one ``iter_embed``'s pool: cancelled together when its caller leaves
    early; one that starts after that is cancelled as it starts."""

    def __init__(self) -> None:
        self._lock, self._calls, self._cancelled = threading.Lock(), set(), False

    def add(self, call: grpc.Future) -> None:
        with self._lock:
            self._calls.add(call)
            if self._cancelled:
                call.cancel()

    def discard(self, call: grpc.Future) -> None:
        with self._lock:
            self._calls.discard(call)

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            for call in self._calls:
                call.cancel()


def _image_index(err: grpc.RpcError) -> int | None:
    """The refused image's index in its request, from the refusal's trailing metadata. A
    request's images are the caller's, in order, from its first index on: a request with
    images left out (skip_invalid) gets no refusal for one image, but errors in its answer."""
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailing or ():
        if (key == wire.IMAGE_INDEX and isinstance(value, str) and value.isascii()
                and value.isdigit()):  # not "\u00b2", a digit int() refuses
            return int(value)
    return None


class FeatureClient(ClientBase):
    """Blocking client. ``with FeatureClient("127.0.0.1:50051") as c: c.embed(["a.jpg"])``."""

    def _call(
        self, method: str, request, timeout: float | None = None, first: int = 0, count: int = 0,
        in_flight: _Calls | None = None,
    ):
        """One call, retried by the client's policy; with ``in_flight``, each attempt's gRPC
        future is held there while it runs, so another thread can cancel it
        (grpc.FutureCancelledError here)."""
        for attempt in itertools.count():
            call = self._pick(method)
            try:
                with _IN_GRPC:
                    if in_flight is None:
                        return call(request, timeout=self._timeout(timeout),
                                    metadata=self.metadata)
                    future = call.future(request, timeout=self._timeout(timeout),
                                         metadata=self.metadata)
                    in_flight.add(future)
                    try:
                        return future.result()
                    finally:
                        in_flight.discard(future)
            except grpc.RpcError as err:
                time.sleep(self._backoff(err, attempt, first, count))
            except ValueError:  # gRPC's "closed channel", closed between the check and the call
                if self.closed:
                    raise RuntimeError(CLOSED) from None
                raise
        raise AssertionError("unreachable")

    def model_info(self, refresh: bool = False) -> pb.ModelInfo:
        """Model, checkpoint fingerprint, mesh, preprocessing contract, output shapes, limits."""
        if self.closed:  # as every call: not the info of a server this client no longer asks
            raise RuntimeError(CLOSED)
        if self._info is None or refresh:
            self._info = self._call("GetModelInfo", pb.GetModelInfoRequest())
        return self._info

    def iter_embed(
        self,
        images,
        *,
        outputs: Sequence[str] = ("pooled",),
        layers: Sequence[int] = (),
        dtype: str = "float32",
        l2_normalize: bool = False,
        normalize_patches: bool = False,
        skip_invalid: bool = False,
        resolution: int = 0,
        dense: bool = False,
        ids: Iterable[str] | None = None,
        batch_size: int | None = None,
        timeout: float | None = None,
        progress: bool = False,
    ) -> Iterator[Embeddings]:
        """Like ``embed``, one ``Embeddings`` per request, in input order, as they complete.

        ``images`` may be any iterable (read lazily): memory stays bounded by ``concurrency``
        requests in flight.
        """
        options, chunks, bar = start_embed(
            images,
            ids,
            self.model_info(),
            progress,
            batch_size,
            outputs=outputs,
            layers=layers,
            dtype=dtype,
            l2_normalize=l2_normalize,
            normalize_patches=normalize_patches,
            skip_invalid=skip_invalid,
            resolution=resolution,
            dense=dense,
        )

        info = self.model_info()

        in_flight = _Calls()  # the pool's calls, cancelled when the caller leaves early

        def run(chunk: list[Item]) -> Embeddings:
            request, sent, local_errors = build_request(chunk, options)
            if not sent:
                return nothing_sent(info, options, local_errors)
            response = self._call("Embed", request, timeout, chunk[0].index, len(chunk),
                                  in_flight)
            return chunk_result(response, sent, local_errors)

        first = next(chunks, None)
        second = next(chunks, None) if first is not None else None
        if second is None:  # a single request: sent from this thread (no pool thread per call)
            try:
                if first is not None:
                    result = run(first)
                    if bar is not None:
                        bar.update(len(first))
                    yield result
            finally:
                if bar is not None:
                    bar.close()
            return
        chunks = itertools.chain((first, second), chunks)
        with ThreadPoolExecutor(self.concurrency) as pool:
            window: deque = deque()
            try:
                for chunk in chunks:
                    window.append((pool.submit(run, chunk), len(chunk)))
                    if len(window) >= self.concurrency:
                        yield _done(window.popleft(), bar)
                while window:
                    yield _done(window.popleft(), bar)
            finally:
                for future, _ in window:
                    future.cancel()
                # an early exit (an error, Ctrl-C, a loop left): the running calls end now,
                # not when their timeout passes (the pool waits for its threads)
                in_flight.cancel()
                if bar is not None:
                    bar.close()

    def embed(self, images, **kwargs) -> Embeddings:
        """Embed paths, bytes, open files, PIL images or uint8 arrays; numpy arrays per output.

        Keywords: ``outputs`` (pooled, class_token, patch_tokens, attention_stats, logits,
        register_tokens, pre_projection; what the model has: ``model_info().outputs``),
        ``layers`` (patch-token blocks; negative count from the end), ``dtype`` (float32,
        bfloat16, float16), ``l2_normalize`` (pooled), ``normalize_patches``, ``skip_invalid``
        (report unreadable images in ``errors`` instead of raising), ``resolution`` (a square
        size the server allows: ``model_info().limits.resolutions``), ``dense`` (aspect ratio
        kept; images of different grids: use ``iter_embed``, one result per image), ``ids``,
        ``batch_size`` (images per request; default: the server's batch), ``timeout``,
        ``progress``. ``grid`` is the (rows, cols) of the patch tokens' rows.
        """
        return merge(list(self.iter_embed(images, **kwargs)))

    def session(self, window: int | None = None):
        """An ``EmbedSession``: ``embed`` calls as messages on one open stream, cheaper than a
        call each for a few images at a time (``clients/session.py``)."""
        from .session import WINDOW, EmbedSession

        return EmbedSession(self, window or WINDOW)

    def embed_videos(self, videos, **kwargs):
        """Per-frame features of videos (paths, bytes or open files; PyAV decodes them here):
        ``frames=K`` or ``stride_s=S``, then ``embed``'s keywords; see
        ``video_features.embed_videos``."""
        from .video_features import embed_videos

        return embed_videos(self, videos, **kwargs)

    def embed_video(self, video, **kwargs):
        """One video: ``.pooled`` [frames, width], ``.temporal_mean``, ``.patch_tokens`` (on
        request), ``.timestamps``; raises ``VideoError`` for a video that cannot be decoded."""
        from .video import VideoError

        result = self.embed_videos([video], **kwargs)
        if result.errors:  # skip_invalid=True: still one video asked for, so raise
            raise VideoError(result.errors[0].id, result.errors[0].reason)
        return result.videos[0]

    def close(self) -> None:
        self.closed = True
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> FeatureClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _done(entry: tuple, bar) -> Embeddings:
    """The result of a (future, image count) window entry; advances the progress bar."""
    future, count = entry
    result = future.result()
    if bar is not None:
        bar.update(count)
    return result
