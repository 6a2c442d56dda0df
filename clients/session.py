"""Sessions: many small ``embed`` calls over one long-lived ``EmbedStream``.

A unary call pays gRPC's per-call setup on both sides (on loopback about 330 us of CPU for a
no-op call with Python's gRPC, more than a small model's forward); a message on an open stream
costs a fraction of that (``benchmarks/grpc_floor.py``). A session keeps one stream open and sends
each ``embed`` as one or more messages on it, so callers that embed a few images at a time (a
web backend, an interactive tool) get the batching server without the per-call cost:

    with client.session() as s:          # or: async with aclient.session() as s
        s.embed([jpeg])                  # same keywords and result as client.embed

Calls may overlap (threads or tasks sharing a session): their requests are pipelined on the
stream, ``window`` in flight, answers matched in order. The server ends a stream at the first
request it refuses; the session then fails that call alone (or retries it, under the client's
``Retry`` policy, when the code is retryable) and resends every later request on a new stream,
to the next address: nothing is lost and no other call sees the error. A stream that ended
UNAVAILABLE (the server draining or not ready, its bound on a stream with no new request, a
lost connection) or cleanly with requests unanswered ended for no fault of its first unanswered
request: that one is sent again at once too, once, before the policy counts it. A stream that
ends in INTERNAL may carry neither the server's status nor its last answers: grpc.aio puts its
own "Internal error from Core" in their place when a write was in flight as the server ended
the stream (grpc/grpc#36066). So the first unanswered request is then asked once more by itself,
as a unary ``Embed``, whose answer or status is the call's. ``timeout`` bounds each
call's wait (a stream has no per-message deadline): a call that times out raises
DEADLINE_EXCEEDED and its late answer is dropped. Unlike a unary call, a request on a stream is
never refused for a full queue: the server waits for room (and HTTP/2 flow control then holds
the sender), so an overloaded server slows a session down instead of failing its calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import grpc
from vit22b.v1 import features_pb2 as pb

from .client import (
    _IN_GRPC,
    _INHERITED,
    _LIVE,
    CLOSED_IN_FLIGHT,
    FeatureError,
    build_request,
    chunk_result,
    nothing_sent,
    start_embed,
)
from .embeddings import Embeddings, ImageError, merge

WINDOW = 16  # requests of one session in flight (the server admits 8 per stream at a time)


@dataclass
class _Entry:
    """One request on its way: what to resend, and where its answer goes."""

    request: pb.EmbedRequest | None  # dropped once answered
    sent: list[int]  # the caller's index of each image sent
    local_errors: list[ImageError]  # inputs of the chunk that could not be read here
    answer: Any  # concurrent.futures.Future or asyncio.Future of the EmbedResponse
    attempt: int = 0
    resent: bool = False  # sent again once, at once, after its stream ended UNAVAILABLE

    @property
    def first(self) -> int:  # the chunk's first index, for error messages
        return min(self.sent[:1] + [e.index for e in self.local_errors[:1]])

    @property
    def count(self) -> int:
        return len(self.sent) + len(self.local_errors)

    def answered(self, response: pb.EmbedResponse) -> None:
        self.request = None
        if not self.answer.done():
            self.answer.set_result(response)

    def refused(self, err: Exception) -> None:
        if not self.answer.done():  # its caller may have given up meanwhile
            self.answer.set_exception(err)

    def unary(self) -> tuple:
        """``_call``'s arguments to ask this request alone, as a unary ``Embed``."""
        return "Embed", self.request, None, self.first, self.count


@dataclass
class _Failover:
    """What to do with a dead stream's unanswered requests (see ``failover``)."""

    resend: list[_Entry]  # at once, in their order
    retry: _Entry | None = None  # the refused one, after ``delay_s``
    delay_s: float = 0.0
    alone: bool = False  # ask ``retry`` by a unary Embed: the stream's status may be lost


def failover(entries: list[_Entry], err: grpc.RpcError, client) -> _Failover:
    """The server answers in order and ends the stream at the first request it refuses, so the
    error belongs to the first unanswered request; the later ones were never run. A closed
    ``client`` (its channels closed under the stream) fails them all: nothing can be resent."""
    if not entries:
        return _Failover([])
    if client.closed:
        for entry in entries:
            entry.refused(RuntimeError(CLOSED_IN_FLIGHT))
        return _Failover([])
    head, rest = entries[0], [e for e in entries[1:] if not e.answer.done()]
    if head.answer.done():  # its caller gave up (timeout, cancel): nobody to tell
        return _Failover(rest)
    if err.code() == grpc.StatusCode.INTERNAL:  # a server bug, or a status grpc.aio lost
        return _Failover(rest, head, alone=True)
    if err.code() == grpc.StatusCode.UNAVAILABLE and not head.resent:
        # the stream ended before the server read it (a drain, the server's bound on a
        # stream's wait for its next request, a lost connection): not a refusal of it, so
        # sent again once at once, as the later ones, before the retry policy counts it
        head.resent = True
        return _Failover([head, *rest])
    try:
        delay = client._backoff(err, head.attempt, head.first, head.count)
    except FeatureError as refused:
        head.refused(refused)
        return _Failover(rest)
    head.attempt += 1
    return _Failover(rest, head, delay)


def _messages(client, images, ids, batch_size, options: dict, unsent: list[Embeddings]):
    """(request, sent indices, local errors) per message, built as they are sent; chunks with
    nothing left to send go to ``unsent`` (their errors, and their outputs with no rows)."""
    opts, chunks, _ = start_embed(images, ids, client._info, False, batch_size, **options)
    for chunk in chunks:
        request, sent, local_errors = build_request(chunk, opts)
        if sent:
            yield request, sent, local_errors
        else:
            unsent.append(nothing_sent(client._info, opts, local_errors))


def _results(entries: list[_Entry], responses: list, unsent: list[Embeddings]) -> Embeddings:
    parts = [chunk_result(response, entry.sent, entry.local_errors)
             for entry, response in zip(entries, responses)]
    return merge([*parts, *unsent])


def _deadline(now: float, timeout: float | None) -> float | None:
    return None if timeout is None else now + timeout


def _left(deadline: float | None, now: float) -> float | None:
    return None if deadline is None else max(0.0, deadline - now)


class _Expired(Exception):
    """Set on the answer an async call waits for when its timeout passes (``_expire``)."""


def _expire(entries: list[_Entry]) -> None:
    """A call's timer: its first unanswered request, the one its caller awaits (the ones before
    are settled), fails; one timer per call, not a timeout scope (a task's cancellation) per
    answer awaited."""
    for entry in entries:
        if not entry.answer.done():
            entry.answer.set_exception(_Expired())
            return


def _timed_out(timeout: float, first: int, count: int) -> FeatureError:
    return FeatureError(grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"no answer within {timeout:g} s on the session's stream", first, count)


_END = object()  # ends a stream's requests (the sync iterator, the async writer)


def _end_when_dropped(session) -> None:
    """End ``session``'s current stream when the session is collected unclosed (its streams
    hold it weakly); the finalizer of the stream it replaces is dropped."""
    _forget_stream(session)
    session._dropped = weakref.finalize(session, session._stream.end)


def _forget_stream(session) -> None:
    """Drop the finalizer of a stream ``session`` no longer uses (replaced, or the parent's
    in a child made by fork, which must not be touched there)."""
    previous = session.__dict__.pop("_dropped", None)
    if previous is not None:
        previous.detach()


class EmbedSession:
    """Blocking session (``FeatureClient.session()``); thread-safe."""

    def __init__(self, client, window: int = WINDOW):
        self._client, self._window = client, window
        self._closed = False
        self._per_process()

    def _per_process(self) -> None:
        """Its stream (opened by the first call), lock and window: this process's alone, made
        anew in a child made by fork and where a session is unpickled."""
        _forget_stream(self)
        self._lock = threading.Lock()
        self._room = threading.Semaphore(self._window)
        self._stream: _SyncStream | None = None
        _LIVE.add(self)

    def _after_fork(self) -> None:
        """The parent's stream is left alone (its reader thread stayed in the parent: a request
        queued on it waited out its whole timeout); the lock and the window are free (another
        of the parent's threads may have held them)."""
        _INHERITED.append(self.__dict__.copy())
        self._per_process()

    def __getstate__(self) -> dict:
        """Pickled as its client (pickled as its settings) and window: a new stream there."""
        return {"_client": self._client, "_window": self._window, "_closed": self._closed}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._per_process()

    def embed(self, images, *, ids=None, batch_size: int | None = None,
              timeout: float | None = None, **options) -> Embeddings:
        """``FeatureClient.embed``'s inputs, keywords and result (``batch_size``: images per
        message)."""
        self._client.model_info()
        unsent: list[Embeddings] = []
        timeout = self._client._timeout(timeout)
        deadline = _deadline(time.monotonic(), timeout)
        entries: list[_Entry] = []
        try:
            for message in _messages(self._client, images, ids, batch_size, options, unsent):
                self._room.acquire()
                entry = _Entry(*message, Future())
                # the room, not the session: an answered entry (the reader's last) may outlive
                # the call, and must not keep a dropped session's stream open
                entry.answer.add_done_callback(lambda _, room=self._room: room.release())
                entries.append(entry)
                self._send(entry)
            responses = []
            for entry in entries:
                try:
                    responses.append(entry.answer.result(_left(deadline, time.monotonic())))
                except FutureTimeout:
                    raise _timed_out(timeout, entry.first, entry.count) from None
        finally:
            for entry in entries:
                entry.answer.cancel()  # no-op for the answered ones
        return _results(entries, responses, unsent)

    def _send(self, entry: _Entry) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the session is closed")
            if self._stream is None or not self._stream.send(entry):
                # a new stream holds the entry from its start: one that dies at once (no
                # server) fails it over through the policy, where a loop would open stream
                # after stream until one lived long enough to take it
                self._stream = _SyncStream(self._client, self._failed, entry)
                _end_when_dropped(self)

    def _failed(self, plan: _Failover) -> None:
        """Called on the dead stream's reader thread, which is free to wait out a backoff."""
        for entry in plan.resend:
            self._resend(entry)
        if plan.alone:
            try:
                plan.retry.answered(self._client._call(*plan.retry.unary()))
            except FeatureError as err:
                plan.retry.refused(err)
        elif plan.retry is not None:
            threading.Event().wait(plan.delay_s)
            self._resend(plan.retry)

    def _resend(self, entry: _Entry) -> None:
        if entry.answer.done():  # its caller gave up meanwhile
            return
        try:
            self._send(entry)
        except RuntimeError as closed:
            entry.refused(closed)

    def close(self) -> None:
        """Ends the stream once the calls in flight are answered."""
        with self._lock:
            self._closed, stream = True, self._stream
        if stream is not None:
            stream.close()

    def __enter__(self) -> EmbedSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _SyncStream:
    """One ``EmbedStream`` call: its requests come from a queue, a thread reads its answers.

    It holds its session weakly (``on_failure``): its reader thread would otherwise keep a
    session its user dropped unclosed, and the stream with it, for ever (a thread, a socket
    and about 150 KB each); the session's finalizer ends the stream instead."""

    def __init__(self, client, on_failure: Callable[[_Failover], None], first: _Entry):
        self._client, self._on_failure = client, weakref.WeakMethod(on_failure)
        self._outbox: queue.Queue = queue.Queue()
        self._pending: deque[_Entry] = deque([first])
        self._outbox.put(first.request)
        self._lock = threading.Lock()
        self.dead = False
        call = client._pick("EmbedStream")
        _IN_GRPC.__enter__()  # until its reader ends
        try:
            self._responses = call(iter(self._outbox.get, _END), metadata=client.metadata)
        except BaseException:
            _IN_GRPC.__exit__()
            raise
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name="vit22b-session-reader")
        self._reader.start()

    def send(self, entry: _Entry) -> bool:
        """False once the stream has ended (the caller opens another)."""
        with self._lock:
            if self.dead:
                return False
            self._pending.append(entry)
            self._outbox.put(entry.request)
        return True

    def _read(self) -> None:
        try:
            for response in self._responses:
                with self._lock:
                    entry = self._pending.popleft()
                entry.answered(response)
            err = None
        except grpc.RpcError as error:
            err = error
        finally:
            _IN_GRPC.__exit__()
        with self._lock:
            self.dead = True
            entries = list(self._pending)
            self._pending.clear()
        self._outbox.put(_END)  # frees gRPC's thread that reads the requests
        on_failure = self._on_failure()
        if entries and on_failure is not None:  # else no caller waits: its session is gone
            on_failure(failover(entries, err or _EndedEarly(), self._client))

    def end(self) -> None:
        """Done writing: the server ends the stream once it has answered what it holds."""
        self._outbox.put(_END)

    def close(self) -> None:
        self.end()
        self._reader.join(timeout=self._client.timeout)


class AsyncEmbedSession:
    """Asyncio session (``AsyncFeatureClient.session()``); tasks of one loop may share it."""

    def __init__(self, client, window: int = WINDOW):
        self._client, self._window = client, window
        self._closed = False
        self._per_process()

    def _per_process(self) -> None:
        """Its stream: bound to a loop of this process (``_bind``), made anew in a child made
        by fork and where a session is unpickled."""
        _forget_stream(self)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stream: _AsyncStream | None = None
        _LIVE.add(self)

    _after_fork = EmbedSession._after_fork
    __getstate__ = EmbedSession.__getstate__
    __setstate__ = EmbedSession.__setstate__

    def _bind(self) -> None:
        """Its stream and window belong to one event loop, as the client's channels do: taken
        up again in a later loop once that one has ended (``asyncio.run`` after
        ``asyncio.run``; the old stream ended with its loop), refused beside a live one."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None and not self._loop.is_closed():
            raise RuntimeError("this session's stream belongs to another event loop, still "
                               "open; open a session in each event loop")
        self._loop, self._stream = loop, None
        self._room = asyncio.Semaphore(self._window)
        self._retries: set[asyncio.Task] = set()

    async def embed(self, images, *, ids=None, batch_size: int | None = None,
                    timeout: float | None = None, **options) -> Embeddings:
        """``AsyncFeatureClient.embed``'s inputs, keywords and result."""
        if self._closed:
            raise RuntimeError("the session is closed")
        self._bind()
        await self._client.model_info()
        unsent: list[Embeddings] = []
        timeout = self._client._timeout(timeout)
        loop = asyncio.get_running_loop()
        entries: list[_Entry] = []
        try:
            for message in _messages(self._client, images, ids, batch_size, options, unsent):
                await self._room.acquire()
                entry = _Entry(*message, loop.create_future())
                # the room, not the session: an answered entry (the reader's last) may outlive
                # the call, and must not keep a dropped session's stream open
                entry.answer.add_done_callback(lambda _, room=self._room: room.release())
                entries.append(entry)
                self._send(entry)
            responses = []
            expiry = None if timeout is None else loop.call_later(timeout, _expire, entries)
            try:
                for entry in entries:
                    try:
                        responses.append(await entry.answer)
                    except _Expired:
                        raise _timed_out(timeout, entry.first, entry.count) from None
            finally:
                if expiry is not None:
                    expiry.cancel()
        finally:
            for entry in entries:
                entry.answer.cancel()  # no-op for the answered ones
        return _results(entries, responses, unsent)

    def _send(self, entry: _Entry) -> None:
        """Queued on the stream at once (no await: a caller cancelled here leaves nothing
        half-sent)."""
        if self._closed:
            raise RuntimeError("the session is closed")
        if self._stream is None or self._stream.dead:
            self._stream = _AsyncStream(self._client, self._failed)
            _end_when_dropped(self)
        self._stream.send(entry)

    def _failed(self, plan: _Failover) -> None:
        def resend(entry: _Entry) -> None:
            if entry.answer.done():  # its caller gave up meanwhile
                return
            try:
                self._send(entry)
            except RuntimeError as closed:
                entry.refused(closed)

        async def run() -> None:
            for entry in plan.resend:
                resend(entry)
            if plan.alone:
                try:
                    plan.retry.answered(await self._client._call(*plan.retry.unary()))
                except FeatureError as err:
                    plan.retry.refused(err)
            elif plan.retry is not None:
                await asyncio.sleep(plan.delay_s)
                resend(plan.retry)

        task = asyncio.get_running_loop().create_task(run())
        self._retries.add(task)
        task.add_done_callback(self._retries.discard)

    async def close(self) -> None:
        self._closed = True
        stream, loop = self._stream, self._loop
        if stream is None:
            return
        if loop is asyncio.get_running_loop():
            await stream.close()
        elif loop.is_running():  # another thread's loop: ended there, not waited for
            with contextlib.suppress(RuntimeError):  # that loop closed meanwhile
                asyncio.run_coroutine_threadsafe(stream.close(), loop)
        # (an ended loop's stream ended with it)

    async def __aenter__(self) -> AsyncEmbedSession:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class _AsyncStream:
    """One ``EmbedStream`` call on grpc.aio: a task writes the requests in the order they were
    queued, another reads the answers.

    Callers only queue and await their answers: grpc.aio cancels the whole call when a write
    is cancelled, so a caller's cancellation must never reach a write (it would end the stream
    under every other caller), and a request is pending (an answer expected) exactly when it
    is queued for writing, so answers always match requests in order."""

    def __init__(self, client, on_failure: Callable[[_Failover], None]):
        # its session held weakly, as _SyncStream's: its tasks would keep a dropped one
        self._client, self._on_failure = client, weakref.WeakMethod(on_failure)
        self._loop = asyncio.get_running_loop()
        self._pending: deque[_Entry] = deque()  # written or queued, unanswered, in order
        self._unwritten: deque = deque()  # entries queued for the writer, then _END
        self._more: asyncio.Future | None = None  # the idle writer waits on it
        self.dead = False
        self._call = client._pick("EmbedStream")(metadata=client.metadata)
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read())
        self._writer = loop.create_task(self._write())

    def send(self, entry: _Entry | object) -> None:
        if entry is not _END:
            self._pending.append(entry)  # before the write: the failover sees it either way
        self._unwritten.append(entry)
        self._wake_writer()

    def _wake_writer(self) -> None:
        if self._more is not None and not self._more.done():
            self._more.set_result(None)

    async def _write(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not self.dead:
                if not self._unwritten:
                    self._more = loop.create_future()
                    await self._more
                    continue
                entry = self._unwritten.popleft()
                if entry is _END:
                    await self._call.done_writing()
                    return
                await self._call.write(entry.request)
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the stream has ended: the reader's failover resends what is pending

    async def _read(self) -> None:
        err = None
        try:
            while True:
                response = await self._call.read()
                if response is grpc.aio.EOF:
                    break
                self._pending.popleft().answered(response)
        except grpc.RpcError as error:
            err = error
        except asyncio.CancelledError:  # grpc.aio's, for a client closed under the stream
            if not self._client.closed or asyncio.current_task().cancelling():
                raise
        self.dead = True
        self._wake_writer()  # it ends: the failover takes what it had not written
        entries = list(self._pending)
        self._pending.clear()
        on_failure = self._on_failure()
        if entries and on_failure is not None:  # else no caller waits: its session is gone
            on_failure(failover(entries, err or _EndedEarly(), self._client))

    def end(self) -> None:
        """Done writing, from any thread (a finalizer runs where the collection happens)."""
        if not self.dead:
            with contextlib.suppress(RuntimeError):  # its loop has closed: the stream with it
                self._loop.call_soon_threadsafe(self.send, _END)

    async def close(self) -> None:
        if not self.dead:
            self.send(_END)  # after every queued request: done writing
        try:
            await asyncio.wait_for(self._reader, self._client.timeout)
        finally:
            self._writer.cancel()  # ended already, unless the stream died under it


class _EndedEarly(grpc.RpcError):
    """A stream that ended cleanly with requests unanswered: resend them (UNAVAILABLE)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the stream ended before answering every request"
