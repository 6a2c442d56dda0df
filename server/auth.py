"""Bearer-token authentication (tokens from a file) and TLS credentials.

Every method needs ``authorization: Bearer <token>`` except the health service, which load
balancers and orchestrators probe without credentials, and server reflection: the schema is
public (features.proto), so generic tools (grpcurl, Postman, reflection-driven clients) can list
and describe the service; every feature call needs the token. A refused call gets
UNAUTHENTICATED before its body is read.
"""

from __future__ import annotations

import hmac
import ssl
from pathlib import Path

import grpc

from .status import refuse

OPEN_SERVICES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)


def read_tokens(path: str | Path) -> tuple[str, ...]:
    """One token per line; blank lines and ``#`` comments are ignored. A token must be printable
    ASCII: gRPC metadata carries nothing else, so any other token could never be presented."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise ValueError(f"token file {path} is not text: {err.reason} at byte {err.start}"
                         ) from None
    tokens = []
    for number, line in enumerate(lines, 1):
        token = line.strip()
        if not token or token.startswith("#"):
            continue
        if not (token.isascii() and token.isprintable()):
            raise ValueError(f"token file {path}, line {number}: a token must be printable "
                             "ASCII (gRPC metadata cannot carry it otherwise)")
        tokens.append(token)
    if not tokens:
        raise ValueError(f"token file {path} holds no token")
    return tuple(tokens)


def check_tls_pair(cert: str | Path, key: str | Path) -> None:
    """The certificate chain and key load and match (gRPC and uvicorn report a bad pair as a
    port they cannot bind, or not at all)."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as err:
        raise ValueError(f"--tls-cert {cert} / --tls-key {key}: cannot be loaded as a PEM "
                         f"certificate chain and its private key: {err}") from None


def server_credentials(cert: str | Path, key: str | Path) -> grpc.ServerCredentials:
    check_tls_pair(cert, key)
    return grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())])


class TokenAuth(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: tuple[str, ...], on_reject=None):
        self._tokens = tuple(t.encode() for t in tokens)
        self._on_reject = on_reject  # called with the method name (metrics)

    def _allowed(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == "authorization" and isinstance(value, str):
                scheme, _, token = value.partition(" ")
                if scheme.lower() == "bearer":
                    given = token.strip().encode()
                    return any(hmac.compare_digest(given, t) for t in self._tokens)
        return False

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        if self._allowed(details.invocation_metadata):
            return handler
        if self._on_reject is not None:
            self._on_reject(details.method)
        return _rejecting(handler)


def _rejecting(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    message = "missing or wrong bearer token (metadata 'authorization: Bearer <token>')"

    async def unary(request, context):
        await refuse(context, grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request_iterator, context):
        await refuse(context, grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator like the real handler

    kind = (handler.request_streaming, handler.response_streaming)
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[kind]
    behaviour = streaming if handler.response_streaming else unary
    return make(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
