"""OpenTelemetry for the router: OTLP/gRPC export, W3C propagation, one span tree per request.

A request span (parented by an incoming `traceparent` header) has the children `validation`
(timed live), `queue` and `inference` (timed from the inference loop's timestamps once the
request ends). The span is the current context while the request is submitted, so the shard
client can carry it to the shards in gRPC metadata.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("pytgi.router")


def wall_clock_offset_ns() -> int:
    """Epoch nanoseconds minus monotonic nanoseconds, now: adding it to a time.monotonic()
    instant gives the epoch time spans carry. Sample it once per conversion batch, so that one
    instant maps to one wall time (queue's end is exactly inference's start)."""
    return time.time_ns() - int(time.monotonic() * 1e9)


def wall_ns(monotonic_s: float, offset_ns: int | None = None) -> int:
    """A time.monotonic() instant as the epoch nanoseconds that spans carry."""
    return int(monotonic_s * 1e9) + (wall_clock_offset_ns() if offset_ns is None else offset_ns)


class RequestTrace:
    """The span tree of one generation request (no-op when tracing is off)."""

    __slots__ = ("span", "_tracer", "_ctx")

    def __init__(self, span: Span, tracer: trace.Tracer | None = None) -> None:
        self.span = span
        self._tracer = tracer
        self._ctx = trace.set_span_in_context(span)

    @contextlib.contextmanager
    def child(self, name: str) -> Iterator[Span]:
        tracer = self._tracer
        if tracer is None:
            yield self.span
            return
        with tracer.start_as_current_span(name, context=self._ctx) as span:
            yield span

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """Makes the request span the current context (for propagation to the shards)."""
        token = otel_context.attach(self._ctx)
        try:
            yield
        finally:
            otel_context.detach(token)

    def phases(self, queued: float, started: float, finished: float) -> None:
        tracer = self._tracer
        if tracer is None:
            return
        offset = wall_clock_offset_ns()
        for name, a, b in (("queue", queued, started), ("inference", started, finished)):
            span = tracer.start_span(name, context=self._ctx, start_time=wall_ns(a, offset))
            span.end(end_time=wall_ns(b, offset))

    def set(self, attributes: Mapping[str, Any]) -> None:
        if self.span.is_recording():
            self.span.set_attributes({k: v for k, v in attributes.items() if v is not None})

    def end(self, error: BaseException | None = None) -> None:
        if error is not None and self.span.is_recording():
            self.span.set_status(Status(StatusCode.ERROR, str(error)))
        self.span.end()


class Tracing:
    def __init__(self, endpoint: str | None = None, service_name: str = "pytgi.router") -> None:
        self._propagator = TraceContextTextMapPropagator()
        self.provider: Any = None
        if endpoint:
            self.provider = _otlp_provider(endpoint, service_name)
            self.tracer: trace.Tracer = self.provider.get_tracer("pytgi.router")
        else:
            self.tracer = trace.NoOpTracer()

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def install_global(self) -> None:
        """Makes the provider the process's (once, from the CLI), so that spans the shard client
        or grpc instrumentation start through the global API are exported too."""
        if self.provider is not None:
            trace.set_tracer_provider(self.provider)

    def request(self, name: str, headers: Mapping[str, str]) -> RequestTrace:
        if self.provider is None:
            return RequestTrace(trace.INVALID_SPAN)
        parent = self._propagator.extract(carrier=headers) if "traceparent" in headers else None
        span = self.tracer.start_span(name, context=parent, kind=SpanKind.SERVER)
        return RequestTrace(span, self.tracer)

    def shutdown(self) -> None:
        if self.provider is not None:
            try:
                self.provider.shutdown()
            except Exception as err:  # exporting is best effort at exit
                log.warning("tracing shutdown: %s", err)


def _otlp_provider(endpoint: str, service_name: str) -> Any:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider
