"""Prometheus metrics on their own registry (several servers can live in one process: tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.exposition import generate_latest

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
            "expired (deadline passed in the queue, not computed), cancelled (caller gone)",
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
        """Expose /metrics over HTTP; port 0 picks a free one. Returns the bound port."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def text(self) -> str:
        return generate_latest(self.registry).decode()
