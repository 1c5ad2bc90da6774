"""A trace per Request (design §12): OpenTelemetry spans from ingest to record, across the
topics a Request crosses.

On only when the standard OpenTelemetry variables ask for an exporter —
``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (OTLP over
HTTP), or ``OTEL_TRACES_EXPORTER=otlp`` / ``console`` — and ``OTEL_SDK_DISABLED`` is not
true; off, every function here is a no-op that allocates nothing (`enabled` is checked
first). ``OTEL_SERVICE_NAME`` names the service (default ``stovepipe``); the SDK reads
the rest of its ``OTEL_*`` settings itself.

The context crosses Kafka in the W3C ``traceparent``/``tracestate`` headers of every
message a stage publishes (`headers_for_publish`) and of every redelivery (a hold, a
retry: `with_current_context`), so a handler's span (kind CONSUMER, named after its
stage) is the child of the span that published its message, and each provider call (git,
the CI, a notifier: `traced`) a child of the handler's span.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_TRACE_HEADERS = (TRACEPARENT, TRACESTATE)
TRACER_NAME = "stovepipe"

enabled = False  # set by `setup` once an exporter is configured


def wanted(env: Mapping[str, str]) -> bool:
    """Whether the environment asks for traces to be exported."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(exporter in ("otlp", "console")
                or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
                or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip())


def setup(environ: Mapping[str, str], *, service: str = "stovepipe",
          exporter: Any = None) -> bool:
    """Turn tracing on when ``environ`` (the process's environment) asks for it, or
    ``exporter`` is given (a test's in-memory exporter, exported at once). Returns
    whether it is on. Idempotent."""
    global enabled
    if enabled:
        return True
    if exporter is None and not wanted(environ):
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create(
        {"service.name": environ.get("OTEL_SERVICE_NAME", service)}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    enabled = True
    return True


def shutdown() -> None:
    """Export what is buffered (a process about to exit)."""
    if enabled:
        provider = trace.get_tracer_provider()
        flush = getattr(provider, "shutdown", None)
        if flush is not None:
            flush()


def _tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


@contextlib.contextmanager
def span(name: str, *, kind: SpanKind = SpanKind.INTERNAL,
         attributes: dict[str, Any] | None = None) -> Iterator[None]:
    """A span as the current one while the block runs (a no-op when tracing is off); an
    exception leaving the block marks it an error."""
    if not enabled:
        yield
        return
    with _tracer().start_as_current_span(name, kind=kind, attributes=attributes or {},
                                         record_exception=True, set_status_on_exception=True):
        yield


@contextlib.contextmanager
def consuming(stage: str, headers: Sequence[tuple[str, bytes]],
              attributes: dict[str, Any]) -> Iterator[None]:
    """The span of one delivery of a ``stage`` message: the child of the span that
    published it (its headers' ``traceparent``), kind CONSUMER."""
    if not enabled:
        yield
        return
    carrier = {k: v.decode("ascii", "replace") for k, v in headers if k in _TRACE_HEADERS}
    parent = propagate.extract(carrier)
    token = otel_context.attach(parent)
    try:
        with _tracer().start_as_current_span(
                f"{stage} process", kind=SpanKind.CONSUMER,
                attributes={"messaging.system": "kafka", "messaging.operation": "process",
                            **attributes}):
            yield
    finally:
        otel_context.detach(token)


def headers_for_publish() -> list[tuple[str, bytes]]:
    """The current span's context as Kafka headers ([] when off or outside a span)."""
    if not enabled:
        return []
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return [(k, v.encode("ascii")) for k, v in carrier.items() if k in _TRACE_HEADERS]


def with_current_context(headers: Sequence[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """``headers`` with their trace context replaced by the current span's (a redelivery:
    its next delivery is the child of this one); unchanged when off."""
    if not enabled:
        return list(headers)
    current = headers_for_publish()
    if not current:
        return list(headers)
    return [*((k, v) for k, v in headers if k not in _TRACE_HEADERS), *current]


def current_trace_id() -> str | None:
    """The current trace's id (32 hex digits), None when off or outside a span."""
    if not enabled:
        return None
    context = trace.get_current_span().get_span_context()
    return f"{context.trace_id:032x}" if context.is_valid else None


def mark_error(message: str) -> None:
    """Mark the current span failed (a delivery dead-lettered or parked)."""
    if enabled:
        trace.get_current_span().set_status(Status(StatusCode.ERROR, message))


def traced(target: Any, component: str, methods: frozenset[str],
           attributes: dict[str, Any]) -> Any:
    """``target`` itself when tracing is off; else a proxy whose coroutine ``methods`` each
    run in a span ``<component>.<method>`` (kind CLIENT): the calls to git, a CI, a
    notifier. Everything else passes through untouched."""
    if not enabled:
        return target
    return _Traced(target, component, methods, attributes)


class _Traced:
    def __init__(self, target: Any, component: str, methods: frozenset[str],
                 attributes: dict[str, Any]) -> None:
        self._target = target
        self._component = component
        self._methods = methods
        self._attributes = attributes

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if name not in self._methods or not inspect.iscoroutinefunction(value):
            return value

        @functools.wraps(value)
        async def call(*args: Any, **kwargs: Any) -> Any:
            with span(f"{self._component}.{name}", kind=SpanKind.CLIENT,
                      attributes=self._attributes):
                return await value(*args, **kwargs)

        return call
