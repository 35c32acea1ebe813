"""Real `pytgi-shard serve` processes for tests: start N ranks, wait until they serve, stop them.

    with start_shards(model_dir, world_size=2) as shards:
        channel = grpc.insecure_channel(shards.urls[0])

Ranks listen on unix sockets under a short temporary directory (socket paths are limited to ~107
bytes) or, with `tcp=True`, on free TCP ports advertising 127.0.0.1. A rank is ready when its
socket exists (unix) or its port accepts connections (TCP); a rank that dies first fails the start
with the tail of its output.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
TAIL_LINES = 40


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def shard_command() -> list[str]:
    """The installed console script next to this interpreter, else the module."""
    script = Path(sys.executable).parent / "pytgi-shard"
    return [str(script)] if script.exists() else [sys.executable, "-m", "pytgi_shard.service.cli"]


@dataclass
class ShardProcesses:
    model_path: Path
    world_size: int
    workdir: Path
    uds_path: str | None
    ports: list[int]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        """gRPC target of each rank, index = rank."""
        if self.uds_path is not None:
            return [f"unix://{self.uds_path}-{r}" for r in range(self.world_size)]
        return [f"127.0.0.1:{p}" for p in self.ports]

    def log_path(self, rank: int) -> Path:
        return self.workdir / f"rank-{rank}.log"

    def output(self, rank: int, lines: int = TAIL_LINES) -> str:
        """The last `lines` lines rank `rank` wrote (stdout and stderr together)."""
        path = self.log_path(rank)
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def _ready(self, rank: int) -> bool:
        if self.uds_path is not None:
            return Path(f"{self.uds_path}-{rank}").exists()
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.ports[rank])) == 0

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for rank, proc in enumerate(self.procs):
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"shard rank {rank} exited with code {proc.returncode} before serving:\n"
                        f"{self.output(rank)}"
                    )
            if all(self._ready(r) for r in range(self.world_size)):
                return
            if time.monotonic() > deadline:
                tails = "\n".join(
                    f"--- rank {r}:\n{self.output(r)}" for r in range(self.world_size)
                )
                raise TimeoutError(f"shards not ready after {timeout:.0f} s:\n{tails}")
            time.sleep(0.1)

    def stop(self) -> list[int | None]:
        """SIGTERM every rank, then SIGKILL what is left; returns the exit codes."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return [p.returncode for p in self.procs]

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ShardProcesses:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()


def start_shards(
    model_path: Path,
    world_size: int = 1,
    *,
    tcp: bool = False,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout: float = START_TIMEOUT_S,
) -> ShardProcesses:
    """Starts `world_size` ranks and waits until all serve; on failure stops them and raises."""
    workdir = Path(tempfile.mkdtemp(prefix="pytgi-shard-"))
    ports = [free_port() for _ in range(world_size)] if tcp else []
    shards = ShardProcesses(
        model_path=model_path,
        world_size=world_size,
        workdir=workdir,
        uds_path=None if tcp else str(workdir / "s"),
        ports=ports,
    )
    master_port = free_port()
    # One thread per rank: the test machine's cores are shared by every rank and the test.
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for rank in range(world_size):
        where = (
            ["--port", str(ports[rank]), "--advertise-address", f"127.0.0.1:{ports[rank]}"]
            if tcp
            else ["--uds-path", str(shards.uds_path)]
        )
        args = [
            *shard_command(), "serve", str(model_path),
            "--rank", str(rank), "--world-size", str(world_size),
            "--master-addr", "127.0.0.1", "--master-port", str(master_port),
            *where, *extra_args,
        ]  # fmt: skip
        with shards.log_path(rank).open("wb") as log:
            shards.procs.append(
                subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=child_env)
            )
    try:
        shards.wait_ready(timeout)
    except BaseException:
        shards.cleanup()
        raise
    return shards
