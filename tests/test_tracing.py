"""Issue 25, item 7: a trace per Request. On a real pipeline run (the CLI's ingest, a real
worker, the real broker and database), every span reaches an OTLP/HTTP receiver run by
the test, as it would reach a collector: one trace from the ingest to the record, a span
per stage and per call to git and the CI, each stage's span the child of the span that
published its message. With the SDK's in-memory exporter, the module's own rules: off
costs nothing, the context crosses Kafka headers."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from streams.extensions import tracing
from tests.pipeline_support import Pipeline
from tests.waiting import wait_until


class _Receiver(ThreadingHTTPServer):
    spans: list[dict[str, Any]]


class _Handler(BaseHTTPRequestHandler):
    server: _Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        request = trace_service_pb2.ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource in request.resource_spans:
            service = next((a.value.string_value for a in resource.resource.attributes
                            if a.key == "service.name"), "")
            for scope in resource.scope_spans:
                for span in scope.spans:
                    self.server.spans.append({
                        "trace": span.trace_id.hex(), "id": span.span_id.hex(),
                        "parent": span.parent_span_id.hex(), "name": span.name,
                        "kind": span.kind, "service": service,
                        "attributes": {a.key: a.value.string_value or a.value.int_value
                                       for a in span.attributes}})
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()
        self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[_Receiver]:
    server = _Receiver(("127.0.0.1", 0), _Handler)
    server.spans = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.kafka
@pytest.mark.postgres
@pytest.mark.slow
def test_one_trace_from_ingest_to_record_across_every_topic(
        pipeline: Pipeline, collector: _Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    port = collector.server_address[1]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    ref = pipeline.add_queue("q")
    pipeline.repo.push(ref, "c1-slow0.5")
    pipeline.start_worker()
    rid = pipeline.ingest("q")
    pipeline.wait_quiet()
    trace_id = json.loads(pipeline.cli("request", rid, "--json").stdout)["request"][
        "trace_id"]
    assert trace_id and len(trace_id) == 32

    def names() -> set[str]:
        return {s["name"] for s in collector.spans if s["trace"] == trace_id}

    stages = {"process process", "build process", "buildsignal process", "record process"}
    wait_until(lambda: stages <= names(), timeout=60, what="every stage's span exported")
    spans = [s for s in collector.spans if s["trace"] == trace_id]
    assert {"ingest q", "git.head", "ci.trigger", "ci.status"} <= names(), names()
    # one trace, one root (the CLI's ingest), every other span a child of one in the trace
    ids = {s["id"] for s in spans}
    roots = [s for s in spans if not s["parent"]]
    assert [r["name"] for r in roots] == ["ingest q"]
    assert all(s["parent"] in ids for s in spans if s["parent"]), spans
    by_id = {s["id"]: s for s in spans}
    # across topics: process's span is the child of the ingest that published to it, and
    # record's the child of a buildsignal delivery that published it
    [process] = [s for s in spans if s["name"] == "process process"]
    assert by_id[process["parent"]]["name"] == "ingest q"
    [record] = [s for s in spans if s["name"] == "record process"]
    assert by_id[record["parent"]]["name"] == "buildsignal process"
    # the worker's log lines of the Request carry the trace id
    assert f"trace_id={trace_id}" in pipeline.full_logs()


def test_off_it_costs_nothing_and_on_the_context_crosses_the_headers() -> None:
    assert not tracing.enabled
    assert tracing.headers_for_publish() == []
    target = object()
    assert tracing.traced(target, "ci", frozenset({"status"}), {}) is target
    with tracing.consuming("build", [], {}):
        assert tracing.current_trace_id() is None

    exporter = InMemorySpanExporter()
    assert tracing.setup({}, exporter=exporter)
    try:
        with tracing.span("ingest q"):
            headers = tracing.headers_for_publish()
            sent_trace = tracing.current_trace_id()
        assert [k for k, _ in headers] == ["traceparent"]
        with tracing.consuming("process", headers, {}):
            assert tracing.current_trace_id() == sent_trace
        spans = {s.name: s for s in exporter.get_finished_spans()}
        assert spans["process process"].parent.span_id == spans["ingest q"].context.span_id
    finally:
        tracing.enabled = False
