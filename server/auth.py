"""Bearer-token authentication (tokens from a file) and TLS credentials.

Every method needs ``authorization: Bearer <token>`` except the health service, which load
balancers and orchestrators probe without credentials, and server reflection: the schema is
public (features.proto), so generic tools (grpcurl, Postman, reflection-driven clients) can list
and describe the service; every feature call needs the token. A refused call gets
UNAUTHENTICATED before its body is read. ``Tokens`` is the one check both doors make: exactly
one ``authorization`` value, the bearer scheme, a token whose SHA-256 is among the file's (a
set lookup: it costs the same whichever token matches, or none). The file is read once, at
start: a token is revoked by a restart.
"""

from __future__ import annotations

import hashlib
import logging
import os
import ssl
import stat
from pathlib import Path

import grpc
from vit22b.model.errors import Unauthenticated

from .parsing import METHOD_HANDLERS
from .status import refuse_with, status_of

log = logging.getLogger(__name__)
# gRPC refuses metadata over 16 KiB in all (value length 20007 vs. 16384): a longer token could
# never be presented there, with the call's other metadata beside it
MAX_TOKEN_BYTES = 8192
MAX_TOKEN_FILE_BYTES = 64 << 20

OPEN_SERVICES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)


def read_tokens(path: str | Path) -> tuple[str, ...]:
    """One token per line; blank lines and ``#`` comments are ignored (and a UTF-8 byte order
    mark, as Notepad writes). A token must be printable ASCII of at most MAX_TOKEN_BYTES: gRPC
    metadata carries nothing else, so any other token could never be presented. Only a regular
    file is read (a FIFO would block the start for ever)."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_TOKEN_FILE_BYTES:
            raise ValueError(f"--token-file {path}: not a regular file of at most "
                             f"{MAX_TOKEN_FILE_BYTES >> 20} MiB")
        lines = Path(path).read_text(encoding="utf-8-sig").splitlines()
    except OSError as err:
        raise ValueError(f"--token-file {path}: {err.strerror or err}") from None
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
        if len(token) > MAX_TOKEN_BYTES:
            raise ValueError(f"token file {path}, line {number}: a token of {len(token)} "
                             f"characters, over {MAX_TOKEN_BYTES} (gRPC metadata cannot carry "
                             "it)")
        tokens.append(token)
    if not tokens:
        raise ValueError(f"token file {path} holds no token")
    return tuple(tokens)


def check_tls_pair(cert: str | Path, key: str | Path) -> None:
    """The certificate chain and key load and match (gRPC and uvicorn report a bad pair as a
    port they cannot bind, or not at all)."""
    def encrypted() -> str:  # else OpenSSL asks for a pass phrase on the terminal, and waits
        raise ValueError(f"--tls-key {key}: the key is encrypted (a pass phrase); give an "
                         "unencrypted PEM key")

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=encrypted)
    except (ssl.SSLError, OSError) as err:
        raise ValueError(f"--tls-cert {cert} / --tls-key {key}: cannot be loaded as a PEM "
                         f"certificate chain and its private key: {err}") from None


def server_credentials(cert: str | Path, key: str | Path) -> grpc.ServerCredentials:
    check_tls_pair(cert, key)
    return grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())])


class Tokens:
    """The accepted bearer tokens, kept as SHA-256 digests."""

    def __init__(self, tokens: tuple[str, ...]):
        self._digests = frozenset(hashlib.sha256(t.encode()).digest() for t in tokens)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def refusal(self, values: list[bytes], where: str) -> str | None:
        """Why a request's ``authorization`` values (all of them; ``where``: how its door
        spells the field) do not admit it, or None: one value, ``Bearer <token>`` (any case,
        spaces around the token), a known token. Two values are refused: the doors would each
        pick one."""
        if not values:
            return f"missing bearer token ({where}: Bearer <token>')"
        if len(values) > 1:
            return f"{len(values)} authorization values: send one ({where}: Bearer <token>')"
        scheme, _, token = values[0].partition(b" ")
        if scheme.lower() != b"bearer":
            return f"not a bearer token ({where}: Bearer <token>')"
        if hashlib.sha256(token.strip()).digest() not in self._digests:
            return "wrong bearer token (not one of the server's --token-file)"
        return None


class TokenAuth(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: Tokens, on_reject=None):
        self._tokens = tokens
        self._on_reject = on_reject  # called with the method name and the code (metrics)

    def _refusal(self, metadata) -> str | None:
        values = [v.encode() if isinstance(v, str) else b"" for k, v in metadata or ()
                  if k == "authorization"]
        return self._tokens.refusal(values, "metadata 'authorization")

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        refusal = self._refusal(details.invocation_metadata)
        if refusal is None:
            return handler
        code = status_of(Unauthenticated()).grpc
        log.info("%s refused: %s (%s)", details.method, code.name, refusal)
        if self._on_reject is not None:
            self._on_reject(details.method, code)
        return _rejecting(handler, refusal)


def _rejecting(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def unary(requests, context):  # the server's handlers all take their requests
        await refuse_with(context, Unauthenticated(message))  # as a stream (unread)

    async def streaming(requests, context):
        await refuse_with(context, Unauthenticated(message))
        yield  # pragma: no cover - makes this an async generator like the real handler

    make = METHOD_HANDLERS[(handler.request_streaming, handler.response_streaming)][1]
    behaviour = streaming if handler.response_streaming else unary
    return make(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
