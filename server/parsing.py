"""Request bodies read and parsed inside the handler, for every service the server hosts.

gRPC's own deserialization of a body that is not the method's message runs outside any handler:
the call ends UNKNOWN and the server logs a traceback for each such request (a log any client can
fill). The feature service parses its bodies itself (``service.parse``); ``ParsingRegistrar``
gives the hosted library services (health, reflection) the same: each of their handlers takes the
raw bytes, and a body that does not parse is INVALID_ARGUMENT naming the method, logged as nothing
more.

Every unary method, ours and theirs, is registered as request-streaming and reads its one message
itself (``only_message``): grpcio's aio server answers a unary call that the client half-closes
with no message only when its deadline passes (never, without one), each such call holding one of
``--max-concurrent-rpcs``' places. Read as a stream, the closed side ends the call at once with
INVALID_ARGUMENT. gRPC's framing does not say how many messages a method takes, so clients see
no difference; a message after the first is ignored, as grpcio's unary handlers ignore it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import grpc
from vit22b.model.errors import InvalidRequest

from .status import refuse_with

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


async def only_message(context: grpc.aio.ServicerContext, method: str) -> bytes:
    """The request message of a unary method registered as request-streaming."""
    raw = await context.read()
    if raw is grpc.aio.EOF:
        raise NoMessage(f"{method} takes one request message; the call was closed with none")
    return raw


class ParsingRegistrar:
    """Stands for the server where a library service adds itself (its ``add_*_to_server``):
    the handlers it registers reach the server parsing their own bodies. Only those services'
    calls pass through this; the feature service's do not."""

    def __init__(self, server: grpc.aio.Server):
        self._server = server

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self._server.add_registered_method_handlers(
            service, {name: _parsing(h, f"/{service}/{name}") for name, h in handlers.items()})

    def add_generic_rpc_handlers(self, generic_handlers) -> None:
        self._server.add_generic_rpc_handlers(tuple(_Parsing(g) for g in generic_handlers))


class _Parsing(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler):
        self._inner = inner

    def service(self, details):
        handler = self._inner.service(details)
        return None if handler is None else _parsing(handler, details.method)


def _parsing(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """``handler`` taking raw bytes, request-streaming: each body parsed by ``parse``, a unary
    method's one body read by ``only_message``."""
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
        async for raw in raw_requests:
            yield await parse(raw, context)

    async def request_of(raw_requests, context):
        if handler.request_streaming:
            return parsed(raw_requests, context)
        try:
            raw = await only_message(context, method)
        except InvalidRequest as err:
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
