"""What grpc.health.v1 says about a shard, following the engine rather than the process.

Kubernetes' gRPC probes and TGI-style tools ask the standard health service (service "" or the
generate service's name). A shard that has loaded but not yet run Warmup has no KV cache sized
for the router's budgets, and one whose device failed answers every step with an error: neither
should take traffic, so both report NOT_SERVING. The states:

- NOT_SERVING from start until a Warmup succeeds, then SERVING;
- NOT_SERVING after an unrecoverable device error (shard/device/failure.py), for good: the
  process then exits so that it is restarted;
- NOT_SERVING after a Warmup that failed past its checks (the KV cache was dropped), until a
  Warmup succeeds;
- NOT_SERVING while the Health RPC (a forward on the engine) fails, SERVING again once it passes.

A separate service, `pytgi.instance.<id>`, is SERVING as soon as the server listens: it tells the
launcher that started this process with `--instance-id <id>` that it is its own child and loaded,
and no other process can answer it.
"""

from __future__ import annotations

import logging

from grpc_health.v1 import health, health_pb2

from pytgi_shard.device.failure import is_device_failure
from pytgi_shard.errors import InvalidRequest, error_chain

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def instance_service(instance_id: str) -> str:
    return f"pytgi.instance.{instance_id}"


class ServingState:
    """Owns the health servicer's statuses for the engine's services."""

    def __init__(self, servicer: health.aio.HealthServicer, services: tuple[str, ...]) -> None:
        self.servicer = servicer
        self.services = services
        self.warmed = False
        self.broken: str | None = None
        self.health_failing = False

    @property
    def status(self) -> int:
        ok = self.warmed and self.broken is None and not self.health_failing
        return SERVING if ok else NOT_SERVING

    async def _publish(self) -> None:
        for name in self.services:
            await self.servicer.set(name, self.status)

    async def start(self, instance_id: str | None) -> None:
        """Called once the server listens: the engine's services are NOT_SERVING until Warmup."""
        await self._publish()
        if instance_id is not None:
            await self.servicer.set(instance_service(instance_id), SERVING)

    async def warmup_done(self) -> None:
        self.warmed = True
        await self._publish()

    async def warmup_failed(self, error: BaseException) -> None:
        """A refused Warmup (InvalidRequest: checked before anything changed) leaves the state
        alone; any other failure may have left the engine without a usable KV cache."""
        if not any(isinstance(e, InvalidRequest) for e in error_chain(error)):
            self.warmed = False
            await self._publish()

    async def health_checked(self, error: BaseException | None) -> None:
        self.health_failing = error is not None
        await self._publish()

    async def call_failed(self, error: BaseException) -> None:
        """Any RPC's unexpected failure: an unrecoverable one turns the shard NOT_SERVING."""
        if is_device_failure(error) and self.broken is None:
            self.broken = f"{type(error).__name__}: {error}"
            log.error("unrecoverable device error: NOT_SERVING from now on (%s)", self.broken)
            await self._publish()
