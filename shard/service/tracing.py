"""OpenTelemetry for a shard: spans exported over OTLP/gRPC, parented by the router's trace.

The router's client interceptor puts its span context in each call's gRPC metadata
(`traceparent`); the aio server interceptor here extracts it, so each RPC's SERVER span (and the
engine's inner spans: forward, sample, concatenate, filter) joins the request's trace.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.grpc import aio_server_interceptor
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor


def setup_tracing(endpoint: str, service_name: str) -> TracerProvider:
    """Installs the global tracer provider; call `shutdown()` on it at exit to flush spans."""
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True))
    )
    trace.set_tracer_provider(provider)
    return provider


def server_interceptors(provider: TracerProvider | None) -> list[Any]:
    """The interceptor that opens a SERVER span per RPC; none when tracing is off."""
    return [aio_server_interceptor(tracer_provider=provider)] if provider is not None else []
