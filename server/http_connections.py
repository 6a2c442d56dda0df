"""The HTTP door's connections, bounded against slow and silent clients.

uvicorn runs one ``BoundedConnection`` per connection (its httptools protocol with these bounds
added, named rather than "auto" since they hook httptools' parser callbacks): a request's headers
within ``--http-header-timeout`` and under ``MAX_HEADER_BYTES``, a response the client reads none
of cut after ``--http-body-timeout``, at most ``--http-max-connections`` open. A connection the
bounds end is answered here, below any route (the door's error body, from ``respond``); the
body's own stall timeout and rate floor are the door's guard's (server/http.py), where the body
is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import ClassVar

import uvicorn
from prometheus_client import Counter
from starlette.responses import Response
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .status import ConnectionRefusal, HeadersTooLarge, RequestTimeout, TooManyConnections

log = logging.getLogger(__name__)

try:
    import fcntl
    import termios

    _OUTQ: int | None = termios.TIOCOUTQ  # SIOCOUTQ on sockets
except (ImportError, AttributeError):  # Windows
    _OUTQ = None

# A request's line and headers (nginx: 4 x 8 KiB, Node.js 16 KiB); httptools has no limit of
# its own and joins a header's pieces as they come: one endless header would grow the memory
# and hold the event loop the gRPC door shares.
MAX_HEADER_BYTES = 64 << 10


@dataclass(frozen=True)
class ClientLimits:
    """What one HTTP client may hold: the ``--http-*`` settings (server/settings.py)."""

    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    min_body_rate: int  # bytes/s a body must average after its first body_timeout_s; 0: none


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket. Its protocol is named (IPPROTO_TCP, as getaddrinfo gives):
    asyncio turns Nagle's algorithm off only on such sockets' connections, and with it on a
    response's separate header and body writes wait out the client's delayed ACK (40 ms)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as err:
        sock.close()
        raise OSError(f"cannot bind HTTP {host}:{port}: {err}") from None
    return sock


class UvicornServer(uvicorn.Server):
    """uvicorn's server without its signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self):
        """The process's SIGTERM / SIGINT handling drains both doors; uvicorn takes none."""
        yield


def _wire(response: Response, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """``response`` as HTTP/1.1 bytes: the connection layer answers where no ASGI cycle runs."""
    code = response.status_code
    lines = [b"HTTP/1.1 %d %s" % (code, HTTPStatus(code).phrase.encode())]
    lines += [b"%s: %s" % pair for pair in [*default_headers, *response.raw_headers]]
    return b"\r\n".join(lines) + b"\r\n\r\n" + response.body


# uvicorn's connection hooks the bounds below override: were one renamed upstream, its bound
# would silently stop applying, so a uvicorn without them is refused when the door starts.
_HOOKS = ("connection_made", "connection_lost", "data_received", "on_message_begin",
          "on_headers_complete", "on_response_complete", "timeout_keep_alive_handler",
          "shutdown", "pause_writing", "resume_writing")


class BoundedConnection(HttpToolsProtocol):
    """uvicorn's httptools connection, bounded against slow and silent clients: nginx's
    client_header_timeout and send_timeout, a header size limit and a cap on connections (the
    body's timeout is the door's guard's, where the body is read). uvicorn's own keep-alive
    timer runs only while a kept-alive connection is idle: the next request's first byte
    disarms it, and nothing bounds the rest of that request.

    The header clock runs from the connection's start, and from the end of each response that
    leaves no request pending, until the next request's headers are complete. Writes are
    watched while the client has unread response bytes: no progress in the body timeout, and
    the connection is cut (a close would wait for them forever)."""

    limits: ClassVar[ClientLimits]
    ended: ClassVar[Counter]  # connections the bounds ended, by reason
    respond: ClassVar[Callable[[BaseException], Response]]  # the door's answer to a refusal
    crowded_warned_at: ClassVar[float] = -math.inf

    @classmethod
    def bounded_by(cls, limits: ClientLimits, ended: Counter,
                   respond: Callable[[BaseException], Response]) -> type[BoundedConnection]:
        """The class uvicorn instantiates per connection (``Config(http=...)``), with ``limits``,
        the counter (a ``reason`` label) of the connections its bounds end and the door's
        answer to a refusal."""
        missing = [name for name in _HOOKS if not callable(getattr(HttpToolsProtocol, name, None))]
        if missing:
            raise RuntimeError(f"uvicorn {uvicorn.__version__}'s HttpToolsProtocol lacks "
                               f"{', '.join(missing)}: the HTTP door's client bounds need them")
        return type(cls.__name__, (cls,), {"limits": limits, "ended": ended,
                                           "respond": staticmethod(respond)})

    def _unsupported_upgrade_warning(self) -> None:
        """An ``Upgrade`` header (h2c, websocket) is served as plain HTTP/1.1, as by any server
        that upgrades to nothing; uvicorn logged two warnings for each such request, a log any
        client could fill. The parser ends such a request at its headers, so a body is not
        read: said in one line, as the door's other refusals are."""
        sizes = [value for name, value in self.headers
                 if name in (b"content-length", b"transfer-encoding")]
        if any(value.strip() not in (b"0", b"") for value in sizes):
            log.info("HTTP request from %s with an Upgrade header and a body: its body is not "
                     "read (send it without 'Connection: Upgrade')", self.client)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._begun = False  # part of a request's line or headers has come
        self._asked = False  # a request has begun on this connection
        self._header_bytes = 0
        self._write_timer: asyncio.TimerHandle | None = None
        self._unread_before = 0  # at the last look
        self._resumed = False  # the buffer drained below its low mark since the last look
        self._running = None  # the request being answered (uvicorn answers one at a time)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._crowded()
        else:
            self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._header_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._write_timer = None
        # uvicorn marks only the last request parsed as gone: an earlier pipelined one still
        # being answered wrote to the closed transport, which uvloop refuses (a traceback at
        # ERROR per connection a client pipelines three requests on and closes); the queued
        # ones never start once it is closed
        running = self._running
        if running is not None and not running.response_complete:
            running.disconnected = True
            running.message_event.set()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # Counted from the chunk after the one a request began in until its headers are
        # complete: never body bytes, and the parser holds at most the limit and two reads.
        counted = self._begun
        super().data_received(data)
        if counted and self._begun and not self.transport.is_closing():
            self._header_bytes += len(data)
            if self._header_bytes > MAX_HEADER_BYTES:
                self.ended.labels("headers_too_large").inc()
                self._refuse(HeadersTooLarge(f"request headers over {MAX_HEADER_BYTES >> 10} "
                                             "KiB"))

    # ---- parser callbacks and uvicorn's hooks --------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._begun, self._asked, self._header_bytes = True, True, 0

    def on_headers_complete(self) -> None:
        self._begun = False
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().on_headers_complete()
        if not (self.pipeline and self.pipeline[0][0] is self.cycle):  # started, not queued
            self._running = self.cycle

    def on_response_complete(self) -> None:
        following = self.pipeline[-1][0] if self.pipeline else None  # what uvicorn starts next
        super().on_response_complete()
        if following is not None and not (self.pipeline and self.pipeline[-1][0] is following):
            self._running = following
        if self.transport.is_closing():
            self._watch_writes()
        elif self.cycle.response_complete:  # no request pending: not even a pipelined one
            self._await_headers()

    def timeout_keep_alive_handler(self) -> None:
        if not self.transport.is_closing():
            self._close()

    def shutdown(self) -> None:
        super().shutdown()
        if self.transport.is_closing():
            self._watch_writes()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._watch_writes()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._resumed = True

    # ---- the bounds --------------------------------------------------------------------
    def _await_headers(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.limits.header_timeout_s,
                                                      self._headers_late)

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self._begun:
            self.ended.labels("header_timeout").inc()
            self._refuse(RequestTimeout(f"request headers not complete in "
                                        f"{self.limits.header_timeout_s:g} s "
                                        "(--http-header-timeout)"))
        else:  # nothing sent (an idle or a silent connection): nothing to answer
            if not self._asked:  # silent from the start; an idle kept-alive one is not counted
                self.ended.labels("silent").inc()
            self._close()

    def _refuse(self, err: ConnectionRefusal) -> None:
        log.info("HTTP connection from %s refused: %s", self.client, err)
        self._answer(err)

    def _crowded(self) -> None:
        cls = type(self)
        now = self.loop.time()
        if now - cls.crowded_warned_at > 10:  # once in a while, not once per connection
            cls.crowded_warned_at = now
            log.warning("HTTP connections over --http-max-connections (%d): new ones get 503",
                        self.limits.max_connections)
        self.ended.labels("too_many_connections").inc()
        self._answer(TooManyConnections(
            f"this server holds its maximum of {self.limits.max_connections} HTTP connections "
            "(--http-max-connections); retry, or reuse a connection"))

    def _answer(self, err: ConnectionRefusal) -> None:
        self.transport.write(_wire(self.respond(err), self.server_state.default_headers))
        self._close()

    def _close(self) -> None:
        self.transport.close()  # once what was written has gone out
        self._watch_writes()

    def _watch_writes(self, unread: int | None = None) -> None:
        unread = self._unread() if unread is None else unread
        if self._write_timer is None and unread:
            self._unread_before, self._resumed = unread, False
            self._write_timer = self.loop.call_later(self.limits.body_timeout_s,
                                                     self._check_writes)

    def _check_writes(self) -> None:
        self._write_timer = None
        unread = self._unread()
        if unread and unread >= self._unread_before and not self._resumed:
            log.info("HTTP connection from %s cut: it read none of its response for %g s "
                     "(--http-body-timeout)", self.client, self.limits.body_timeout_s)
            self.ended.labels("response_unread").inc()
            self.transport.abort()
        else:
            self._watch_writes(unread)

    def _unread(self) -> int:
        """Response bytes the client has not taken while some wait in our buffer: those, and
        the kernel's unacknowledged ones (Linux's SIOCOUTQ). The buffer alone moves only when
        the kernel's has a third free, up to a megabyte or more of the client's reading."""
        unread = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        if unread and _OUTQ is not None and sock is not None:
            with contextlib.suppress(OSError, ValueError):
                unread += struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, bytes(4)))[0]
        return unread
