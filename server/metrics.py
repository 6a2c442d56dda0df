"""Prometheus metrics on their own registry (several servers can live in one process: tests),
and the bounded HTTP server that exposes them."""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import threading
import time
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import generate_latest

log = logging.getLogger(__name__)

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_IMAGES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "vit22b_requests",
            "Calls by method (gRPC method, or HTTP route) and status (its gRPC code name)",
            ["method", "code"],
            registry=r,
        )
        self.images = Counter(
            "vit22b_images",
            "Images by outcome: computed, invalid, rejected (queue full), "
            "expired (deadline passed in the queue, not computed), cancelled (caller gone), "
            "non_finite (computed, then refused: NaN or Inf)",
            ["outcome"],
            registry=r,
        )
        self.batch_images = Histogram(
            "vit22b_batch_images", "Real images per computed batch", buckets=_IMAGES, registry=r
        )
        self.batches = Counter(
            "vit22b_batches", "Computed batches by patch grid (rows x cols)", ["grid"], registry=r
        )
        self.padding_images = Counter(
            "vit22b_padding_images", "Zero images added to fill batch buckets", registry=r
        )
        self.queue_seconds = Histogram(
            "vit22b_queue_seconds",
            "From submission to the start of a job's first batch",
            buckets=_SECONDS,
            registry=r,
        )
        self.preprocess_seconds = Histogram(
            "vit22b_preprocess_seconds",
            "Decoding and preprocessing per call",
            buckets=_SECONDS,
            registry=r,
        )
        self.compute_seconds = Histogram(
            "vit22b_compute_seconds", "Forward time per batch", buckets=_SECONDS, registry=r
        )
        self.queue_images = Gauge(
            "vit22b_queue_images", "Images admitted and not yet computed", registry=r
        )
        self.unread_bytes = Gauge(
            "vit22b_unread_response_bytes",
            "Bytes of gRPC answers admitted and not yet read by their clients "
            "(bounded by --max-unread-mb)", registry=r,
        )
        self.compilations = Gauge(
            "vit22b_on_demand_compilations", "Forwards compiled after warm-up", registry=r
        )
        self.http_connections_ended = Counter(
            "vit22b_http_connections_ended",
            "HTTP connections ended by the door's client bounds: header_timeout (408), silent "
            "(nothing sent within the header timeout), headers_too_large (431), "
            "too_many_connections (503), response_unread (cut)",
            ["reason"],
            registry=r,
        )
        self._http = None

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Expose /metrics over HTTP (prometheus_client's exposition: its formats and gzip);
        port 0 picks a free one. Returns the bound port."""
        server_class = type("MetricsServer", (ScrapeServer,), {
            "address_family": socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]})
        self._http = make_server(host, port, make_wsgi_app(self.registry), server_class,
                                 handler_class=_QuietHandler)
        threading.Thread(target=self._http.serve_forever, name="vit22b-metrics",
                         daemon=True).start()
        return self._http.server_port

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


# A scrape is one short request. prometheus_client's own server gives every connection a thread
# that waits on it for ever: a thousand idle connections were a thousand threads of the serving
# process. Here a few connections are served at once (one more is answered 503 and closed), a
# silent one is dropped after SCRAPE_TIMEOUT_S, and none is held past SCRAPE_DEADLINE_S, however
# it drips its bytes.
MAX_SCRAPES = 16
SCRAPE_TIMEOUT_S = 10.0
SCRAPE_DEADLINE_S = 30.0
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class _QuietHandler(WSGIRequestHandler):
    timeout = SCRAPE_TIMEOUT_S  # on every read and write of the connection

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        """No line per scrape."""


class ScrapeServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most ``MAX_SCRAPES`` at once, each cut at its deadline by
    one watchdog thread."""

    daemon_threads = True
    request_queue_size = 128  # listen()'s backlog (socketserver's 5 left a burst of
    # connections waiting on the kernel's retransmissions, seconds, instead of a quick 503)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_SCRAPES)
        self._open: dict[socket.socket, float] = {}
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name="vit22b-metrics-watch", daemon=True).start()

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.sendall(_BUSY)
            self.shutdown_request(request)
            return
        self._open[request] = time.monotonic()
        try:
            super().process_request(request, client_address)
        except BaseException:  # the thread did not start: its slot is free again
            self._done(request)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(request)

    def _done(self, request) -> None:
        if self._open.pop(request, None) is not None:
            self._slots.release()

    def _watch(self) -> None:
        while not self._closed.wait(1.0):
            late = time.monotonic() - SCRAPE_DEADLINE_S
            for request, started in list(self._open.items()):
                if started < late:
                    with contextlib.suppress(OSError):
                        request.shutdown(socket.SHUT_RDWR)  # its thread's read or write ends

    def handle_error(self, request, client_address) -> None:
        """A client that went silent, was cut at its deadline or left: not news (the base
        class prints a traceback per connection)."""
        if not isinstance(sys.exc_info()[1], OSError):
            log.exception("metrics request from %s failed", client_address[0])

    def server_close(self) -> None:
        self._closed.set()
        super().server_close()

    def text(self) -> str:
        return generate_latest(self.registry).decode()
