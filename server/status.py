"""The one table mapping the service's failures (``model/errors.py``) to transport statuses.

TEI / Triton style: an exception takes the entry of its nearest class in the table (its own,
else the closest base class); anything not in the table is a bug and becomes INTERNAL / 500.
Each failure has its gRPC code and its HTTP status side by side, so the two doors cannot drift
apart. HTTP choices: a full queue or a full compile cache is 429 (with ``Retry-After``); a body
or response over the message limit is 413; non-finite outputs are 422 (the request was well
formed, its result cannot be returned in the asked dtype); a caller that went away is 499
(nginx's "client closed request": nobody reads it); an HTTP client too slow with its headers or
body is 408 (a gRPC call's message that did not come in time: DEADLINE_EXCEEDED), one whose
headers are over the limit 431, a body in a coding or media type the door does not read 415.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple, NoReturn

import grpc
from vit22b.model.errors import (
    CallerGone,
    DeadlineExpired,
    Draining,
    InvalidRequest,
    NonFiniteOutput,
    NotReady,
    QueueFull,
    TooLarge,
    Unauthenticated,
)
from vit22b.v1.wire import WireError


class ConnectionRefusal(Exception):
    """The HTTP door's connection layer refused a client (too slow, too large, too many): its
    answer is the last on that connection."""


class RequestTimeout(ConnectionRefusal):
    """Headers or a body that did not come in time (``--http-header-timeout`` / ``-body-``)."""


class MessageTimeout(Exception):
    """A unary gRPC call's request message that did not come within ``--grpc-message-timeout``."""


class StreamIdle(Exception):
    """A request stream with no new message within ``--grpc-message-timeout``, its answers all
    sent: ended, its requests not answered (sent as it ended) to be sent again."""


class HeadersTooLarge(ConnectionRefusal):
    pass


class TooManyConnections(ConnectionRefusal):
    """Over ``--http-max-connections``."""


class UnsupportedBody(InvalidRequest):
    """An HTTP body this server does not read: a content coding other than gzip or deflate, or
    a media type that is not JSON (an image file, a form, multipart)."""


class Status(NamedTuple):
    grpc: grpc.StatusCode
    http: int


_C = grpc.StatusCode
STATUSES: dict[type[BaseException], Status] = {
    TooLarge: Status(_C.INVALID_ARGUMENT, 413),
    InvalidRequest: Status(_C.INVALID_ARGUMENT, 400),
    UnsupportedBody: Status(_C.INVALID_ARGUMENT, 415),  # HTTP's body only
    WireError: Status(_C.INVALID_ARGUMENT, 400),
    QueueFull: Status(_C.RESOURCE_EXHAUSTED, 429),  # CompileLimit too
    DeadlineExpired: Status(_C.DEADLINE_EXCEEDED, 504),
    CallerGone: Status(_C.CANCELLED, 499),
    Draining: Status(_C.UNAVAILABLE, 503),
    NotReady: Status(_C.UNAVAILABLE, 503),
    Unauthenticated: Status(_C.UNAUTHENTICATED, 401),
    NonFiniteOutput: Status(_C.OUT_OF_RANGE, 422),  # e.g. float16 overflow: ask another dtype
    # HTTP's connection layer only (gRPC has its own transport bounds)
    RequestTimeout: Status(_C.DEADLINE_EXCEEDED, 408),
    HeadersTooLarge: Status(_C.INVALID_ARGUMENT, 431),
    TooManyConnections: Status(_C.UNAVAILABLE, 503),
    # gRPC's door only: its bound on each wait for a request message (server/parsing.py)
    MessageTimeout: Status(_C.DEADLINE_EXCEEDED, 408),
    StreamIdle: Status(_C.UNAVAILABLE, 408),  # retryable, as a drain's end of a stream
}
INTERNAL = Status(_C.INTERNAL, 500)
RETRY_AFTER_S = 1  # HTTP 429 / 503 ``Retry-After``: the queue drains within batches


def status_of(err: BaseException) -> Status:
    for cls in type(err).__mro__:
        if cls in STATUSES:
            return STATUSES[cls]
    return INTERNAL


async def refuse_with(context: grpc.aio.ServicerContext, err: BaseException) -> NoReturn:
    """End a gRPC call with ``err``'s entry in the table and its message."""
    await refuse(context, status_of(err).grpc, str(err))


async def refuse(context: grpc.aio.ServicerContext, code: grpc.StatusCode,
                 message: str, trailing: tuple = ()) -> NoReturn:
    """End a gRPC call with ``code`` (``context.abort``), also one that ended meanwhile.

    A call whose deadline passes (or whose client leaves) between the failure and its answer
    makes the abort itself fail inside gRPC's core, which gRPC logs as an error of the server.
    Nobody is left to tell: the call ends as cancelled (gRPC logs that at debug level)."""
    try:
        await context.abort(code, message, trailing)
    except grpc.aio.AbortError:
        raise  # the status was sent: how abort unwinds the handler
    except Exception as err:  # noqa: BLE001 - gRPC core's ExecuteBatchError (not public)
        raise asyncio.CancelledError(f"the call ended before its {code.name}") from err
