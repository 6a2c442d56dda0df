"""Every failure the service knows, and the one table mapping each to a gRPC status code.

The engine, batcher and preprocessing raise these plain exceptions (usable in-process, no gRPC
needed); only the transport layer turns them into status codes, through ``STATUS_CODES``.
Anything not in the table is a bug and becomes INTERNAL.
"""

from __future__ import annotations

import grpc
from vit22b.v1.wire import WireError


class InvalidRequest(ValueError):
    """The request as a whole is malformed (outputs, dtype, layers, sizes, image count)."""


class InvalidImage(InvalidRequest):
    """One image cannot be used; the message names its index (and client id) and the reason."""

    def __init__(self, reason: str, index: int | None = None, image_id: str = ""):
        self.reason, self.index, self.image_id = reason, index, image_id
        where = (
            "" if index is None else f"image {index}" + (f" (id {image_id!r})" if image_id else "")
        )
        super().__init__(f"{where}: {reason}" if where else reason)

    def at(self, index: int, image_id: str = "") -> InvalidImage:
        return InvalidImage(self.reason, index, image_id)


class QueueFull(Exception):
    """Admission refused: the queue holds its maximum of images."""


class DeadlineExpired(Exception):
    """The caller's deadline passed before its images were computed; they were not computed."""


class CallerGone(Exception):
    """The caller cancelled or disconnected; its remaining images were not computed."""


class Draining(Exception):
    """The server is shutting down and takes no new work."""


class NotReady(Exception):
    """The engine is still compiling; health is NOT_SERVING until it is done."""


class Unauthenticated(Exception):
    """Missing or wrong bearer token."""


# The table (TEI / Triton style): the first entry matching an exception's class hierarchy wins.
STATUS_CODES: dict[type[BaseException], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    WireError: grpc.StatusCode.INVALID_ARGUMENT,
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DeadlineExpired: grpc.StatusCode.DEADLINE_EXCEEDED,
    CallerGone: grpc.StatusCode.CANCELLED,
    Draining: grpc.StatusCode.UNAVAILABLE,
    NotReady: grpc.StatusCode.UNAVAILABLE,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
}


def status_code(err: BaseException) -> grpc.StatusCode:
    for cls in type(err).__mro__:
        if cls in STATUS_CODES:
            return STATUS_CODES[cls]
    return grpc.StatusCode.INTERNAL
