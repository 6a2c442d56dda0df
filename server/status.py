"""The one table mapping the service's failures (``model/errors.py``) to transport status codes.

TEI / Triton style: the first entry matching an exception's class hierarchy wins; anything not
in the table is a bug and becomes INTERNAL. Every door (gRPC, HTTP) maps through ``status_code``.
"""

from __future__ import annotations

import grpc
from vit22b.model.errors import (
    CallerGone,
    DeadlineExpired,
    Draining,
    InvalidRequest,
    NonFiniteOutput,
    NotReady,
    QueueFull,
    Unauthenticated,
)
from vit22b.v1.wire import WireError

STATUS_CODES: dict[type[BaseException], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    WireError: grpc.StatusCode.INVALID_ARGUMENT,
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DeadlineExpired: grpc.StatusCode.DEADLINE_EXCEEDED,
    CallerGone: grpc.StatusCode.CANCELLED,
    Draining: grpc.StatusCode.UNAVAILABLE,
    NotReady: grpc.StatusCode.UNAVAILABLE,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    NonFiniteOutput: grpc.StatusCode.OUT_OF_RANGE,  # e.g. float16 overflow: ask another dtype
}


def status_code(err: BaseException) -> grpc.StatusCode:
    for cls in type(err).__mro__:
        if cls in STATUS_CODES:
            return STATUS_CODES[cls]
    return grpc.StatusCode.INTERNAL
