"""Request bodies parsed inside the handler, for every service the server hosts.

gRPC's own deserialization of a body that is not the method's message runs outside any handler:
the call ends UNKNOWN and the server logs a traceback for each such request (a log any client can
fill). The feature service parses its bodies itself (``service.parse``); ``ParsingRegistrar``
gives the hosted library services (health, reflection) the same: each of their handlers takes the
raw bytes, and a body that does not parse is INVALID_ARGUMENT naming the method, logged as nothing
more.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable

import grpc

from .status import refuse

_MAKE = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


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
    deserialize = handler.request_deserializer
    if deserialize is None:  # takes raw bytes already
        return handler
    name, make = _MAKE[(handler.request_streaming, handler.response_streaming)]
    behaviour = getattr(handler, name)

    async def parse(raw: bytes, context):
        try:
            return deserialize(raw)
        except Exception as err:  # noqa: BLE001 - any decode failure is the client's body
            await refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                         f"request body of {method} does not parse: {err}")

    async def parsed(raw_requests: AsyncIterator[bytes], context):
        async for raw in raw_requests:
            yield await parse(raw, context)

    async def request_of(raw, context):
        return parsed(raw, context) if handler.request_streaming else await parse(raw, context)

    if handler.response_streaming and inspect.isasyncgenfunction(behaviour):
        async def run(raw, context):  # a handler that yields its answers
            async for response in behaviour(await request_of(raw, context), context):
                yield response
    else:
        async def run(raw, context):  # returns its answer, or writes them (context.write)
            return await _awaited(behaviour, await request_of(raw, context), context)

    return make(run, request_deserializer=None, response_serializer=handler.response_serializer)


async def _awaited(behaviour: Callable, request, context):
    result = behaviour(request, context)
    return await result if inspect.isawaitable(result) else result
