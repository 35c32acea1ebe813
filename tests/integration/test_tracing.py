"""OpenTelemetry across processes: an in-process OTLP collector receives the router's request span
tree (parented by the client's `traceparent`) and the shard's RPC spans, which join the router's
batch spans in one trace through gRPC metadata."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.router_process import RouterProcess
from tests.shard_process import start_shards

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every exported span as (service.name, span)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []
        self._lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC method name)
        with self._lock:
            for rs in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    self.spans.extend((attrs.get("service.name", ""), s) for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, pred: Callable[[list[tuple[str, Any]]], bool], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if pred(list(self.spans)):
                    return
            time.sleep(0.1)
        raise AssertionError(f"spans never arrived: {[(s, x.name) for s, x in self.spans]}")


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, str]]:
    servicer = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"http://127.0.0.1:{port}"
    server.stop(0)


def test_router_and_shard_spans_reach_the_collector(
    collector: tuple[Collector, str], tiny_model: Callable[..., Path]
) -> None:
    spans, endpoint = collector
    model = tiny_model("llama")
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # export every 100 ms instead of 5 s
    with start_shards(model, extra_args=["--otlp-endpoint", endpoint], env=env) as shards, \
            RouterProcess(shards.urls[0], model, "--otlp-endpoint", endpoint, env=env) as router:
        r = httpx.post(f"{router.url}/generate", timeout=60,
                       headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
                       json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}})
        assert r.status_code == 200

        def request_tree(found: list[tuple[str, Any]]) -> bool:
            names = {s.name for svc, s in found if s.trace_id.hex() == TRACE_ID}
            return {"generate", "validation", "queue", "inference"} <= names

        spans.wait_for(request_tree)

        def shard_joined_router(found: list[tuple[str, Any]]) -> bool:
            router_traces = {s.trace_id for svc, s in found if svc == "pytgi.router"}
            return any(svc != "pytgi.router" and s.trace_id in router_traces for svc, s in found)

        spans.wait_for(shard_joined_router)

    found = spans.spans
    by_name = {s.name: s for svc, s in found if s.trace_id.hex() == TRACE_ID}
    root = by_name["generate"]
    assert root.parent_span_id.hex() == PARENT_ID  # the client's span is the parent
    for child in ("validation", "queue", "inference"):
        assert by_name[child].parent_span_id == root.span_id
    assert by_name["queue"].end_time_unix_nano <= by_name["inference"].start_time_unix_nano + 1
    attrs = {a.key for a in root.attributes}
    assert {"total_time", "inference_time", "generated_tokens"} <= attrs
    services = {svc for svc, _ in found}
    assert "pytgi.router" in services and len(services) >= 2
    # Shard RPC spans are children of router spans of the same trace (propagated via gRPC).
    router_ids = {s.span_id for svc, s in found if svc == "pytgi.router"}
    shard = [s for svc, s in found if svc != "pytgi.router"]
    assert any(s.parent_span_id in router_ids for s in shard)
