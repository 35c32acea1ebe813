"""Is a child ready? A shard: its socket (or port) accepts and grpc.health.v1 says SERVING for
the service the launcher asks about (its own instance's, so a stranger never counts).
The router: GET /health answers 200 (it answers only after connecting to and warming the shards).
"""

from __future__ import annotations

from pathlib import Path

PROBE_TIMEOUT = 2.0


def shard_target(uds_path: str) -> str:
    return f"unix://{uds_path}"


def shard_serving(target: str, service: str = "", timeout: float = PROBE_TIMEOUT) -> bool:
    """One health probe of `service` at `target` (grpc form: unix:///path or host:port); an
    unknown service (NOT_FOUND) is not serving."""
    if target.startswith("unix://") and not Path(target.removeprefix("unix://")).exists():
        return False
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def local_url(hostname: str, port: int) -> str:
    """Where the launcher itself reaches the router it bound on `hostname`."""
    if hostname in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif hostname in ("::", "[::]"):
        host = "[::1]"
    elif ":" in hostname and not hostname.startswith("["):
        host = f"[{hostname}]"
    else:
        host = hostname
    return f"http://{host}:{port}"


def router_healthy(base_url: str, timeout: float = PROBE_TIMEOUT) -> bool:
    import httpx

    try:
        return httpx.get(f"{base_url}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False
