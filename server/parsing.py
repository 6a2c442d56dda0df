"""Request bodies read and parsed inside the handler, for every service the server hosts.

gRPC's own deserialization of a body that is not the method's message runs outside any handler:
the call ends UNKNOWN and the server logs a traceback for each such request (a log any client can
fill). The feature service parses its bodies itself (``service.parse``); ``ParsingRegistrar``
gives the hosted library services (health, reflection) the same: each of their handlers takes the
raw bytes, and a body that does not parse is INVALID_ARGUMENT naming the method, logged as nothing
more.

Every unary method, ours and theirs, is registered as request-streaming and reads its one message
itself (``MessageWaits.only_message``): grpcio's aio server answers a unary call that the client
half-closes with no message only when its deadline passes (never, without one), each such call
holding one of ``--max-concurrent-rpcs``' places. Read as a stream, the closed side ends the call
at once with INVALID_ARGUMENT. gRPC's framing does not say how many messages a method takes, so
clients see no difference; a message after the first is ignored, as grpcio's unary handlers
ignore it.

Reading them also bounds the wait for them (``--grpc-message-timeout``): a call whose message
never comes, or never comes whole, would hold its handler and a ``--max-concurrent-rpcs`` place
for ever. gRPC shows a handler no progress within a message, so the bound is on the whole wait:
a unary call's message then ends the call DEADLINE_EXCEEDED; a request stream with no new
message that long, once it owes no answer, ends UNAVAILABLE (retryable: a request its client
sent as it ended was not read, and is to be sent again, as after a drain). A drain ends the
feature service's waits at once (UNAVAILABLE), so none holds it; the hosted services' are not
drained (a liveness probe is answered through a drain).
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import AsyncIterator, Callable

import grpc
from vit22b.model.errors import Draining, InvalidRequest

from .infer import DRAIN_RESEND, DRAIN_RETRY
from .status import MessageTimeout, StreamIdle, refuse_with

# (request streaming, response streaming) -> the handler's behaviour attribute and its factory
METHOD_HANDLERS = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


class NoMessage(InvalidRequest):
    """A unary call that ended its requests with none. Also what the handler reads when gRPC
    refused the message itself (over the server's receive limit): the client then has
    RESOURCE_EXHAUSTED, and this refusal finds the call ended."""


_LATE = "no request message in time"  # the cancel message of a wait past its bound
_DRAIN = "draining"  # ... of a wait the server's drain ended


class MessageWaits:
    """The server's waits for request messages, each bounded by ``timeout_s``, and (given the
    server's ``draining`` event) ended by its drain. A sweep every ``period_s`` (a quarter of
    the bound, from 50 ms to a second) cancels the waits past their bound, so a wait ends within
    one period after it. A timer per wait (``asyncio.timeout``) cost 4.2 us a message, about 1%
    of a small model's call; an entry in a dict 1.1 us (``python benchmarks/message_waits.py``;
    on the serving path, ``serve_against.py``: no difference the runs' spread shows)."""

    def __init__(self, timeout_s: float, draining: asyncio.Event | None = None):
        self.timeout_s = timeout_s
        self.period_s = min(1.0, max(0.05, timeout_s / 4))
        self._draining = draining  # None: never drained (the hosted health and reflection)
        self._due: dict[asyncio.Task, float] = {}  # the waiting tasks, and when each is late
        self._sweep_handle: asyncio.TimerHandle | None = None

    async def wait(self, awaitable, held: bool = False, drained: str = DRAIN_RESEND):
        """``awaitable``'s result; TimeoutError once it has waited ``timeout_s`` (not while
        ``held``: until ``start_clock``); Draining(``drained``) once the server drains."""
        if self._draining is not None and self._draining.is_set():
            awaitable.close()
            raise Draining(drained)
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        self._due[task] = math.inf if held else loop.time() + self.timeout_s
        if self._sweep_handle is None:
            self._sweep_handle = loop.call_later(self.period_s, self._sweep, loop)
        cancels = task.cancelling()
        try:
            return await awaitable
        except asyncio.CancelledError as cancel:
            # ours, unless another cancel came too (the call ended): then it goes on as theirs
            if cancel.args not in ((_LATE,), (_DRAIN,)) or task.uncancel() > cancels:
                raise
            if cancel.args == (_DRAIN,):
                raise Draining(drained) from None
            raise TimeoutError from None
        finally:
            self._due.pop(task, None)

    def start_clock(self, task: asyncio.Task) -> None:
        """Time ``task``'s wait from now (a held one: a stream whose last owed answer was just
        sent)."""
        if task in self._due:
            self._due[task] = asyncio.get_running_loop().time() + self.timeout_s

    def drain(self) -> None:
        """End every wait now with Draining (the later ones end so at once, the server's
        ``draining`` set): a call waiting for its message would hold the drain to its bound."""
        for task in list(self._due):
            task.cancel(_DRAIN)
        self._due.clear()

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        for task, due in list(self._due.items()):
            # a task whose awaited result came is about to resume with it: a cancel now would
            # drop a message already read
            if due <= now and not _resuming(task):
                del self._due[task]
                task.cancel(_LATE)
        self._sweep_handle = (loop.call_later(self.period_s, self._sweep, loop) if self._due
                              else None)

    async def only_message(self, context: grpc.aio.ServicerContext, method: str) -> bytes:
        """The request message of a unary method registered as request-streaming."""
        try:  # a drain tells it as it tells a call refused at its start
            raw = await self.wait(context.read(), drained=DRAIN_RETRY)
        except TimeoutError:
            raise MessageTimeout(f"{method}: its request message did not come within "
                                 f"{self.timeout_s:g} s (--grpc-message-timeout)") from None
        if raw is grpc.aio.EOF:
            raise NoMessage(f"{method} takes one request message; the call was closed with none")
        return raw

    async def next_message(self, messages: AsyncIterator[bytes], method: str,
                           held: bool = False) -> bytes | None:
        """A request stream's next message, None at its end; StreamIdle if none came whole in
        time (not counting the time it is ``held``)."""
        try:
            return await self.wait(anext(messages, None), held)
        except TimeoutError:
            raise StreamIdle(
                f"{method}: no request message for {self.timeout_s:g} s "
                "(--grpc-message-timeout): the stream is ended; send any request not answered "
                "again, on a new stream") from None


def _resuming(task: asyncio.Task) -> bool:
    """Whether ``task`` is scheduled to run: the future it awaited (``_fut_waiter``, which
    asyncio's tasks expose) is done, or it awaits none. A task without the attribute counts as
    waiting: the bound holds, only this guard is lost."""
    waiter = getattr(task, "_fut_waiter", _NO_WAITER)
    return waiter is not _NO_WAITER and (waiter is None or waiter.done())


_NO_WAITER = object()


class ParsingRegistrar:
    """Stands for the server where a library service adds itself (its ``add_*_to_server``):
    the handlers it registers reach the server parsing their own bodies. Only those services'
    calls pass through this; the feature service's do not."""

    def __init__(self, server: grpc.aio.Server, waits: MessageWaits):
        self._server, self._waits = server, waits

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self._server.add_registered_method_handlers(service, {
            name: _parsing(h, f"/{service}/{name}", self._waits)
            for name, h in handlers.items()})

    def add_generic_rpc_handlers(self, generic_handlers) -> None:
        self._server.add_generic_rpc_handlers(
            tuple(_Parsing(g, self._waits) for g in generic_handlers))


class _Parsing(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler, waits: MessageWaits):
        self._inner, self._waits = inner, waits

    def service(self, details):
        handler = self._inner.service(details)
        return None if handler is None else _parsing(handler, details.method, self._waits)


def _parsing(handler: grpc.RpcMethodHandler, method: str,
             waits: MessageWaits) -> grpc.RpcMethodHandler:
    """``handler`` taking raw bytes, request-streaming: each body parsed by ``parse``, a unary
    method's one body read by ``waits.only_message``, each wait for a body bounded by ``waits``."""
    deserialize = handler.request_deserializer or (lambda raw: raw)
    kind = (handler.request_streaming, handler.response_streaming)
    behaviour = getattr(handler, METHOD_HANDLERS[kind][0])

    async def parse(raw: bytes, context):
        try:
            return deserialize(raw)
        except Exception as err:  # noqa: BLE001 - any decode failure is the client's body
            await refuse_with(context, InvalidRequest(
                f"request body of {method} does not parse: {err}"))

    async def parsed(raw_requests, context):
        messages = aiter(raw_requests)
        while True:
            try:
                raw = await waits.next_message(messages, method)
            except StreamIdle as err:  # (these waits are never drained)
                await refuse_with(context, err)
            if raw is None:
                return
            yield await parse(raw, context)

    async def request_of(raw_requests, context):
        if handler.request_streaming:
            return parsed(raw_requests, context)
        try:
            raw = await waits.only_message(context, method)
        except (InvalidRequest, MessageTimeout) as err:
            await refuse_with(context, err)
        return await parse(raw, context)

    if handler.response_streaming and inspect.isasyncgenfunction(behaviour):
        async def run(raw_requests, context):  # a handler that yields its answers
            async for response in behaviour(await request_of(raw_requests, context), context):
                yield response
    else:
        async def run(raw_requests, context):  # returns its answer, or writes them (context.write)
            return await _awaited(behaviour, await request_of(raw_requests, context), context)

    make = METHOD_HANDLERS[(True, handler.response_streaming)][1]
    return make(run, request_deserializer=None, response_serializer=handler.response_serializer)


async def _awaited(behaviour: Callable, request, context):
    result = behaviour(request, context)
    return await result if inspect.isawaitable(result) else result
