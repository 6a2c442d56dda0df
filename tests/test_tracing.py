"""Tracing on both doors: the spans of a call, parented to the trace context the client sent,
seen by an in-memory exporter, and exported over OTLP to a collector on loopback."""

from __future__ import annotations

import base64
import logging
import socket
import threading
from concurrent import futures

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from serving import png, random_images, raw_image, start_server, stub, wait_for
from vit22b.server import tracing
from vit22b.server.tracing import Tracing
from vit22b.v1 import features_pb2 as pb

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
STEPS = {"admission", "preprocess", "queue", "compute"}


@pytest.fixture(scope="module")
def traced():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    srv = start_server(http_port=0, max_delay_ms=20, tracing=Tracing(provider))
    yield srv, exporter
    srv.stop()


def _call_spans(exporter: InMemorySpanExporter, name: str):
    """The call span named ``name`` and its children, once all have ended."""
    wait_for(lambda: any(s.name == name for s in exporter.get_finished_spans()), timeout=10)
    spans = exporter.get_finished_spans()
    call = next(s for s in spans if s.name == name)
    mine = call.context.span_id
    children = [s for s in spans if s.parent is not None and s.parent.span_id == mine]
    return call, children


def _check(call, children, images: int) -> None:
    assert format(call.context.trace_id, "032x") == TRACE_ID  # the client's trace
    assert format(call.parent.span_id, "016x") == PARENT_ID and call.parent.is_remote
    assert call.kind == SpanKind.SERVER
    assert {s.name for s in children} == STEPS
    by_name = {s.name: s for s in children}
    assert by_name["admission"].attributes["vit22b.images"] == images
    compute = [s for s in children if s.name == "compute"]
    assert sum(s.attributes["vit22b.batch.rows"] for s in compute) == images
    for span in compute:
        assert span.attributes["vit22b.batch.bucket"] >= span.attributes["vit22b.batch.images"]
    queue = by_name["queue"]
    assert queue.end_time <= min(s.start_time for s in compute)  # queued, then computed
    for span in children:
        assert call.start_time <= span.start_time <= span.end_time <= call.end_time


def test_http_call_spans_are_children_of_the_callers_context(traced):
    srv, exporter = traced
    exporter.clear()
    body = {"images": [base64.b64encode(png(p)).decode() for p in random_images(3, 31)]}
    response = httpx.post(srv.http_url + "/v1/features", json=body, timeout=60,
                          headers={"traceparent": TRACEPARENT})
    assert response.status_code == 200
    call, children = _call_spans(exporter, "POST /v1/features")
    _check(call, children, 3)
    assert call.attributes["http.route"] == "/v1/features"


def test_grpc_call_spans_are_children_of_the_callers_context(traced):
    srv, exporter = traced
    exporter.clear()
    request = pb.EmbedRequest(images=[raw_image(p) for p in random_images(5, 32)])
    stub(srv.address).Embed(request, timeout=60, metadata=[("traceparent", TRACEPARENT)])
    call, children = _call_spans(exporter, "vit22b.v1.FeatureService/Embed")
    _check(call, children, 5)
    assert call.attributes["rpc.method"] == "Embed"


def test_a_refused_call_is_marked_with_both_statuses(traced):
    srv, exporter = traced
    exporter.clear()
    response = httpx.post(srv.http_url + "/v1/features", json={"images": ["AAAA"]}, timeout=60,
                          headers={"traceparent": TRACEPARENT})
    assert response.status_code == 400
    call, _ = _call_spans(exporter, "POST /v1/features")
    assert call.attributes["http.response.status_code"] == 400
    assert call.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert not call.status.is_ok and "image 0" in call.status.description


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.names: list[str] = []
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 - the OTLP service's method name
        with self.lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    self.names += [span.name for span in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


def test_otlp_endpoint_exports_the_spans_to_a_collector():
    collector = _Collector()
    receiver = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, receiver)
    port = receiver.add_insecure_port("127.0.0.1:0")
    receiver.start()
    try:
        srv = start_server(otlp_endpoint=f"http://127.0.0.1:{port}")
        try:
            request = pb.EmbedRequest(images=[raw_image(p) for p in random_images(2, 33)])
            stub(srv.address).Embed(request, timeout=60)
        finally:
            srv.stop()  # flushes the batch of spans
        assert "vit22b.v1.FeatureService/Embed" in collector.names
        assert STEPS <= set(collector.names)
    finally:
        receiver.stop(None)


def test_a_collector_that_does_not_answer_holds_the_stop_for_shutdown_s_at_most(
        monkeypatch, caplog):
    """A collector down, silent or retrying held the end of a drain for the exporter's own
    shutdown wait; the stop now waits ``SHUTDOWN_S`` and says so."""
    monkeypatch.setattr(tracing, "SHUTDOWN_S", 0.5)
    caplog.set_level(logging.WARNING)
    with socket.socket() as silent:  # the kernel accepts the connection; nothing answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        traced = Tracing.export_to(f"http://127.0.0.1:{silent.getsockname()[1]}")
        with traced.call("vit22b.v1.FeatureService/Embed", {}):
            pass
        traced.shutdown()
    assert "no answer from the collector within 0.5 s" in caplog.text


def test_tracing_is_off_by_default():
    srv = start_server()
    try:
        assert not srv.server.tracing.on and srv.server.tracing.provider is None
    finally:
        srv.stop()
