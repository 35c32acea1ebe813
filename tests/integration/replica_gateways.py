"""Two pytgi replicas (a shard and a router each, the router on a port of its own so that it can
be restarted there) and the real gateways from PyPI in front of them: SGLang's
(`sglang-router launch`) and vLLM's (`vllm-router`), both Rust binaries installed by the test
extra. Shared by tests/integration/test_sglang_router.py and test_vllm_router.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
        # Its log goes to a file: a pipe nobody reads fills up (64 KiB of warnings during a
        # restart test) and then blocks the gateway mid-test.
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (lives as the gateway does)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, text=True)
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
        """What the gateway has logged so far."""
        self.log.seek(0)
        return self.log.read()

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
        """Every router signalled before any is waited for; stop()'s own SIGTERM is then their
        second signal, which stops at once (nothing is in flight at teardown), so teardown does
        not wait out a drain grace per replica."""
        for router in self.routers:
            if router.proc is not None and router.proc.poll() is None:
                router.signal()
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


@dataclass(frozen=True)
class Outcome:
    """One request of a RequestStream: when it was sent and answered, and the status (0: no
    answer at all)."""

    sent: float
    done: float
    status: int
    body: str


class RequestStream:
    """`clients` threads sending short completions through `url` back to back, until stop():
    a steady stream of traffic, every outcome kept."""

    def __init__(self, url: str, clients: int = 2) -> None:
        self.url = url
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self, client: int) -> None:
        with httpx.Client(timeout=60) as http:
            n = 0
            while not self._stop.is_set():
                n += 1
                sent = time.monotonic()
                try:
                    r = http.post(f"{self.url}/v1/completions", json={
                        "model": "tiny", "prompt": f"client {client} request {n}:",
                        "max_tokens": 8, "temperature": 0})
                    status, body = r.status_code, r.text
                except httpx.HTTPError as err:
                    status, body = 0, repr(err)
                self.outcomes.append(Outcome(sent, time.monotonic(), status, body))

    def wait_for(self, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.outcomes) < count:
            assert time.monotonic() < deadline, f"only {len(self.outcomes)} answers"
            time.sleep(0.05)

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(90)
        return list(self.outcomes)


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
