"""Two pytgi replicas (a shard and a router each, the router on a port of its own so that it can
be restarted there) and the real gateways from PyPI in front of them: SGLang's
(`sglang-router launch`) and vLLM's (`vllm-router`), both Rust binaries installed by the test
extra. Shared by tests/integration/test_sglang_router.py and test_vllm_router.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.router_process import RouterProcess
from tests.shard_process import ShardProcesses, free_port, start_shards

BIN = str(Path(sys.executable).parent)
SGLANG = shutil.which("sglang-router", path=BIN)
VLLM = shutil.which("vllm-router", path=BIN)
# The replicas' router flags: one served name, small limits, and a drain grace (SIGTERM: /health
# 503 while still serving) longer than the gateways' health checks below take to notice.
REPLICA_FLAGS = ("--served-model-name", "tiny", "--max-input-tokens", "400",
                 "--max-total-tokens", "420", "--drain-grace-seconds", "3")
# Both gateways: /health every second, one failure takes a worker out, one success puts it back
# (their defaults, 60 s and 3 failures, would keep sending to a draining replica for minutes).
HEALTH_FLAGS = ("--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                "--health-success-threshold", "1")


def binary_runs(binary: str | None, *probe: str) -> str | None:
    """Why `binary` cannot run here (None: it can)."""
    if binary is None:
        return "the gateway is not installed (pip install 'pytgi[test]')"
    try:
        subprocess.run([binary, *probe, "--help"], capture_output=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as err:
        return f"{binary} does not run here: {err}"
    return None


class Gateway:
    """A gateway process in front of `workers`, ready once it lists every worker as healthy."""

    def __init__(self, argv: list[str], workers: list[str], port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.workers = workers
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        deadline = time.monotonic() + 60
        while not self.all_healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{argv[0]} did not start:\n{self.output()}")
            time.sleep(0.2)

    def healthy(self) -> set[str]:
        """The workers the gateway would send to now."""
        try:
            listed = httpx.get(f"{self.url}/workers", timeout=5)
        except httpx.HTTPError:
            return set()
        if listed.status_code != 200:
            return set()
        return {w["url"] for w in listed.json().get("workers") or [] if w.get("is_healthy", True)}

    def all_healthy(self) -> bool:
        return self.healthy() == set(self.workers)

    def output(self) -> str:
        if self.proc.poll() is None:
            return ""
        assert self.proc.stdout is not None
        return self.proc.stdout.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def sglang_gateway(workers: list[str], policy: str, *flags: str) -> Gateway:
    assert SGLANG is not None
    port = free_port()
    return Gateway([SGLANG, "launch", "--host", "127.0.0.1", "--port", str(port),
                    "--policy", policy, "--worker-urls", *workers,
                    "--prometheus-port", str(free_port()), *HEALTH_FLAGS,
                    "--log-level", "warn", *flags], workers, port)


def vllm_gateway(workers: list[str], policy: str, prometheus_port: int, *flags: str) -> Gateway:
    assert VLLM is not None
    port = free_port()
    return Gateway([VLLM, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                    "--worker-urls", *workers, "--prometheus-port", str(prometheus_port),
                    *HEALTH_FLAGS, "--log-level", "warning", *flags], workers, port)


class Replicas:
    """Two replicas on fixed ports; `restart(i)` starts replica i's router again on its port
    (its shard stays up: the router is the part that drains and that a gateway sees)."""

    def __init__(self, model: Path, shards: list[ShardProcesses]) -> None:
        self.model = model
        self.shards = shards
        self.ports = [free_port() for _ in shards]
        self.routers = [self._start(i) for i in range(len(shards))]

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def _start(self, i: int) -> RouterProcess:
        return RouterProcess(self.shards[i].urls[0], self.model, *REPLICA_FLAGS,
                             "--port", str(self.ports[i])).start()

    def restart(self, i: int) -> None:
        self.routers[i].kill()
        self.routers[i] = self._start(i)

    def stop(self) -> None:
        for router in self.routers:
            try:
                router.stop()
            finally:
                router.kill()


@pytest.fixture(scope="module", name="replicas")
def replicas_fixture(model: Path) -> Iterator[Replicas]:
    """Two shard + router pairs serving the tiny model under one served name."""
    with start_shards(model) as one, start_shards(model) as two:
        pair = Replicas(model, [one, two])
        try:
            yield pair
        finally:
            pair.stop()
