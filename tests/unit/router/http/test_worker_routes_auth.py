"""/flush_cache changes a replica's state, so --api-key guards it; the probes a gateway polls
without a key (/health, /metrics) stay open. HttpGuard in front of a plain route."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from pytgi_router.http.app import HttpGuard


async def _ok(request: Request) -> Response:
    return Response("ok")


def test_flush_cache_needs_the_key_probes_do_not() -> None:
    paths = ["/flush_cache", "/health", "/metrics", "/server_info"]
    inner = Starlette(routes=[Route(p, _ok, methods=["GET", "POST"]) for p in paths])
    client = TestClient(HttpGuard(inner, payload_limit=1000, api_key="k"))
    assert client.post("/flush_cache").status_code == 401
    assert client.post("/flush_cache", headers={"authorization": "Bearer k"}).status_code == 200
    assert client.get("/server_info").status_code == 401
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
