"""The asyncio twin of ``FeatureClient``: the same options, chunking, retries and results."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import AsyncIterator, Iterable

import grpc
from vit22b.v1 import features_pb2 as pb

from .client import (
    CLOSED,
    CLOSED_IN_FLIGHT,
    ClientBase,
    build_request,
    check_fork,
    chunk_result,
    nothing_sent,
    start_embed,
)
from .embeddings import Embeddings, merge
from .inputs import Item


class AsyncFeatureClient(ClientBase):
    """``async with AsyncFeatureClient(addr) as c: r = await c.embed(images)``.

    Constructor and ``embed`` keywords are those of ``FeatureClient``.
    """

    _grpc = grpc.aio
    _loop: asyncio.AbstractEventLoop | None = None  # the loop its channels belong to

    def _per_process(self) -> None:
        super()._per_process()
        self._loop = None  # its channels are made in the loop of its first call

    def _after_fork(self) -> None:
        global _FORKED_FROM_AIO
        # grpc.aio's state is the process's: in a child forked while the parent held grpc.aio
        # channels (closed or not, until collected), every grpc.aio call hangs past its
        # deadline or crashes the child, in a client inherited or made there, with
        # GRPC_ENABLE_FORK_SUPPORT or without
        _FORKED_FROM_AIO = _FORKED_FROM_AIO or bool(self._channels)
        super()._after_fork()

    def _pick(self, method: str):
        """grpc.aio's channels belong to the event loop they are made in: they are made at the
        first call, so a client made outside any loop (at import, before ``asyncio.run``)
        works in the loop it is used in, and again in a later loop once that one has ended
        (``asyncio.run`` after ``asyncio.run``)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop and not self.closed:
            check_fork()
            if _FORKED_FROM_AIO:
                raise RuntimeError(FORKED_FROM_AIO)
            if self._loop is not None and not self._loop.is_closed():
                raise RuntimeError(OTHER_LOOP)
            self._loop = loop
            self._open()
        return super()._pick(method)

    async def _call(
        self, method: str, request, timeout: float | None = None, first: int = 0, count: int = 0
    ):
        for attempt in itertools.count():
            call = self._pick(method)
            try:
                return await call(request, timeout=self._timeout(timeout),
                                  metadata=self.metadata)
            except grpc.RpcError as err:
                await asyncio.sleep(self._backoff(err, attempt, first, count))
            except asyncio.CancelledError:
                # grpc.aio cancels the calls of a channel being closed: that is no
                # cancellation of the caller's task (which would then end as cancelled)
                if self.closed and not asyncio.current_task().cancelling():
                    raise RuntimeError(CLOSED_IN_FLIGHT) from None
                raise
            except grpc.aio.UsageError:  # closed between the check and the call
                if self.closed:
                    raise RuntimeError(CLOSED) from None
                raise
        raise AssertionError("unreachable")

    async def model_info(self, refresh: bool = False) -> pb.ModelInfo:
        if self.closed:
            raise RuntimeError(CLOSED)
        if self._info is None or refresh:
            self._info = await self._call("GetModelInfo", pb.GetModelInfoRequest())
        return self._info

    async def iter_embed(
        self,
        images,
        *,
        ids: Iterable[str] | None = None,
        batch_size: int | None = None,
        timeout: float | None = None,
        progress: bool = False,
        **options,
    ) -> AsyncIterator[Embeddings]:
        """One ``Embeddings`` per request, in input order, ``concurrency`` requests in flight."""
        info = await self.model_info()
        options, chunks, bar = start_embed(images, ids, info, progress, batch_size, **options)

        async def run(chunk: list[Item]) -> Embeddings:
            # Reading files and packing pixels stays off the event loop.
            request, sent, local_errors = await asyncio.to_thread(build_request, chunk, options)
            if not sent:
                return nothing_sent(info, options, local_errors)
            response = await self._call("Embed", request, timeout, chunk[0].index, len(chunk))
            return chunk_result(response, sent, local_errors)

        window: deque = deque()
        try:
            for chunk in chunks:
                window.append((asyncio.ensure_future(run(chunk)), len(chunk)))
                if len(window) >= self.concurrency:
                    yield await _done(window.popleft(), bar)
            while window:
                yield await _done(window.popleft(), bar)
        finally:
            for task, _ in window:
                task.cancel()
            if bar is not None:
                bar.close()

    async def embed(self, images, **kwargs) -> Embeddings:
        return merge([part async for part in self.iter_embed(images, **kwargs)])

    def session(self, window: int | None = None):
        """An ``AsyncEmbedSession``: ``FeatureClient.session``'s twin."""
        from .session import WINDOW, AsyncEmbedSession

        return AsyncEmbedSession(self, window or WINDOW)

    async def close(self) -> None:
        self.closed = True
        if self._loop is asyncio.get_running_loop():
            await _close(self._channels)
        elif self._loop is not None and self._loop.is_running():
            # another thread's loop: its channels are closed there (their calls in flight end
            # as they would here), not waited for; an ended loop's channels ended with it
            with contextlib.suppress(RuntimeError):  # that loop closed meanwhile
                asyncio.run_coroutine_threadsafe(_close(self._channels), self._loop)

    async def __aenter__(self) -> AsyncFeatureClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


OTHER_LOOP = ("this AsyncFeatureClient's channels belong to another event loop, still open; "
              "make one client per event loop")
FORKED_FROM_AIO = (
    "grpc.aio does not work in a process made by fork from one holding an AsyncFeatureClient "
    "that has made calls (closed or not, until it is garbage-collected): its calls would hang "
    "or crash; start the worker processes with spawn or forkserver "
    "(multiprocessing.get_context('spawn')), or use FeatureClient in them")
_FORKED_FROM_AIO = False  # set in a child made by fork (``_after_fork``)


async def _close(channels: list) -> None:
    for channel in channels:
        await channel.close()


async def _done(entry: tuple, bar) -> Embeddings:
    task, count = entry
    result = await task
    if bar is not None:
        bar.update(count)
    return result
