"""Checks the reliability tests share: an error answer is in TGI's shape, and the router came out
of a hostile test unharmed."""

from __future__ import annotations

import httpx

from tests.integration.http_helpers import metric
from tests.router_process import RouterProcess


def error_body(r: httpx.Response) -> dict[str, str]:
    """The body of an error answer, checked to be `{"error": str, "error_type": str}` JSON."""
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error", "error_type"}, body
    assert isinstance(body["error"], str) and body["error"]
    assert isinstance(body["error_type"], str) and body["error_type"]
    return body  # type: ignore[no-any-return]


def assert_unharmed(router: RouterProcess, client: httpx.Client) -> None:
    """Healthy and alive, no shard call failed, every KV block free, no unhandled error logged."""
    url = router.url
    assert client.get(f"{url}/health").status_code == 200
    assert router.proc is not None and router.proc.poll() is None
    for method in ("prefill", "decode"):
        assert metric(url, "tgi_batch_inference_failure", method=method) == 0
    assert metric(url, "pytgi_kv_blocks_free") == metric(url, "pytgi_kv_blocks_total")
    assert "Traceback" not in router.output and "unhandled error" not in router.output
