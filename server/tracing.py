"""Request tracing with OpenTelemetry, for both doors; off (no spans, no context work) by default.

A call is one server span (``vit22b.v1.FeatureService/Embed``, ``POST /v1/features``), parented
to the W3C trace context the caller sent (``traceparent`` / ``tracestate``: HTTP headers or gRPC
metadata), with children from the facade: ``admission`` (room in the queue), ``preprocess``
(decode and the pixel contract), ``queue`` (submission to the first batch holding its rows) and
one ``compute`` per batch that held its rows (the batch's images and bucket as attributes). The
batcher's compute thread records when each batch ran; the facade turns those records into spans
after the fact, so the compute thread never touches the tracer. With ``--otlp-endpoint`` spans
are exported over OTLP/gRPC in batches; tests hand a provider with an in-memory exporter.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .status import Status

log = logging.getLogger(__name__)

_OFF = contextlib.nullcontext()
_PROPAGATOR = TraceContextTextMapPropagator()
# What a stop waits for the last spans: a collector down or retrying held the end of a drain
# for the exporter's own shutdown wait (30 s by default).
SHUTDOWN_S = 5.0
# OpenTelemetry's loggers that warn, one line a call, about a caller's trace context (its
# ``tracestate`` text copied in): the context is ignored either way.
CLIENT_TEXT_LOGGERS = ("opentelemetry.trace.span", "opentelemetry.trace.propagation")


def check_otlp_endpoint(value: str) -> str | None:
    """What is wrong with an OTLP/gRPC collector's address, or None. Without a scheme the
    exporter takes TLS to port 443 and exports nothing to a plaintext collector, saying so only
    at its first export; a path (OTLP/HTTP's ``/v1/traces``) it drops."""
    if not value:
        return None  # off
    if len(value) > 2048 or not value.isprintable() or " " in value:
        return "must be a URL such as http://127.0.0.1:4317"
    try:
        url = urlsplit(value)
        port = url.port
    except ValueError as err:
        return f"is not a URL ({err}), e.g. http://127.0.0.1:4317"
    if url.scheme not in ("http", "https") or not url.hostname:
        return (f"must name http:// (plaintext) or https:// (TLS) and a host, e.g. "
                f"http://127.0.0.1:4317, got {value!r}")
    if url.path.strip("/") or url.query or url.fragment:
        return (f"takes no path: OTLP/gRPC is served at the collector's root (4317; "
                f"/v1/traces is OTLP/HTTP's), got {value!r}")
    if port == 0:
        return f"names port 0, where no collector listens, got {value!r}"
    return None


class Tracing:
    """The spans of one server; every method is a no-op when ``provider`` is None."""

    def __init__(self, provider=None, owned: bool = False):
        self.provider, self._owned = provider, owned  # owned: made here, shut down here
        self._tracer = None if provider is None else provider.get_tracer("vit22b.server")

    @classmethod
    def export_to(cls, endpoint: str | None, service: str = "vit22b") -> Tracing:
        """Spans exported over OTLP/gRPC to ``endpoint`` (``http://host:4317``), or off."""
        if not endpoint:
            return cls()
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": service}),
                                  shutdown_on_exit=False)  # ``shutdown`` bounds it
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        return cls(provider, owned=True)

    @property
    def on(self) -> bool:
        return self._tracer is not None

    def call(self, name: str, carrier: Callable[[], Iterable] | Mapping | None, **attributes):
        """The span of one call, current inside the ``with``, child of the caller's context.

        ``carrier``: the call's headers or metadata (a mapping, or a function giving pairs:
        only called when tracing is on). Failures are marked by the door (``failed``)."""
        if self._tracer is None:
            return _OFF
        headers = carrier() if callable(carrier) else carrier
        parent = _PROPAGATOR.extract(dict(headers or ()))
        return self._tracer.start_as_current_span(
            name, context=parent, kind=SpanKind.SERVER, attributes=attributes,
            record_exception=False, set_status_on_exception=False,
        )

    def step(self, name: str, **attributes):
        """A child span of the current one (``admission``, ``preprocess``); attributes are
        named ``vit22b.<name>``."""
        if self._tracer is None:
            return _OFF
        named = {f"vit22b.{key}": value for key, value in attributes.items()}
        return self._tracer.start_as_current_span(name, attributes=named)

    def failed(self, status: Status, err: BaseException) -> None:
        """Mark the current call span with the failure's status (both doors' codes)."""
        if self._tracer is None:
            return
        span = trace.get_current_span()
        span.set_attribute("rpc.grpc.status_code", status.grpc.value[0])
        span.set_attribute("http.response.status_code", status.http)
        span.set_status(StatusCode.ERROR, f"{type(err).__name__}: {err}"[:500])

    def job(self, job) -> None:
        """``queue`` and ``compute`` spans from a batcher job's records (after it settled)."""
        if self._tracer is None:
            return
        batches = list(job.batches)
        queued = self._tracer.start_span("queue", start_time=job.submitted_ns,
                                         attributes={"vit22b.images": job.size})
        queued.end(end_time=batches[0].start_ns if batches else time.time_ns())
        for batch in batches:
            span = self._tracer.start_span("compute", start_time=batch.start_ns, attributes={
                "vit22b.batch.images": batch.images,
                "vit22b.batch.bucket": batch.bucket,
                "vit22b.batch.rows": batch.rows,  # this call's rows in the batch
            })
            span.end(end_time=batch.end_ns)

    def shutdown(self) -> None:
        """Export what is buffered and stop (a provider made here only), waiting at most
        ``SHUTDOWN_S``: a collector that does not answer keeps the rest."""
        if not self._owned:
            return
        stop = threading.Thread(target=self.provider.shutdown, name="vit22b-trace-stop",
                                daemon=True)
        stop.start()
        stop.join(SHUTDOWN_S)
        if stop.is_alive():
            log.warning("trace export: no answer from the collector within %g s; the spans "
                        "not yet exported are dropped", SHUTDOWN_S)
