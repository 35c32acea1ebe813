"""A server under benchmark in a child process (`ServerProcess`: ready when /health answers 200,
stopped with SIGTERM, then SIGKILL, on exit; its log goes to a file whose tail a failure shows),
and the real pytgi server on it: `pytgi-launcher` (`PytgiServer`). llama.cpp's server
(`llama_cpp_server.LlamaCppServer`) is the other one, so both start, wait and stop alike."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx


class ServerStartError(RuntimeError):
    """The server died or never became healthy; the message ends with its last log lines."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ServerProcess:
    """A child server's life: `start` launches `command()` in a session of its own (so a stop
    reaches its children too) and waits for /health; `stop` asks with SIGTERM, then kills the
    group. Subclasses give the command and their name, and may give an environment."""

    name = "server"
    poll_s = 0.5  # between /health tries while it starts
    stop_timeout_s = 30.0  # between SIGTERM and SIGKILL

    def __init__(self, log_path: Path, port: int | None, start_timeout_s: float) -> None:
        self.log_path = log_path
        self.port = port or free_port()
        self.start_timeout_s = start_timeout_s
        self.startup_s: float | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def _env(self) -> dict[str, str] | None:
        """The child's environment; None: this process's own."""
        return None

    def _started(self, process: subprocess.Popen[bytes]) -> None:
        """Called once the child is launched, before waiting for it to be healthy."""

    def _stopped(self) -> None:
        """Called once the child is gone (or was never launched) after `stop`."""

    def start(self) -> Self:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                             env=self._env(), start_new_session=True)
        self._started(self._process)
        deadline = started + self.start_timeout_s
        while time.perf_counter() < deadline:
            if self._process.poll() is not None:
                raise ServerStartError(
                    f"{self.name} exited with code {self._process.returncode} while starting; "
                    f"log {self.log_path}:\n{_tail(self.log_path)}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    self.startup_s = time.perf_counter() - started
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(self.poll_s)
        self.stop()
        raise ServerStartError(
            f"{self.name} was not healthy after {self.start_timeout_s:.0f} s; "
            f"log {self.log_path}:\n{_tail(self.log_path)}"
        )

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        try:
            if process.poll() is None:
                # A launcher owns its children: SIGTERM lets it shut them down cleanly.
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=self.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
        finally:
            self._stopped()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class PytgiServer(ServerProcess):
    """`with PytgiServer(model_dir, log) as server:` ... `server.url`."""

    name = "pytgi"

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        *,
        port: int | None = None,
        threads: int | None = None,
        extra_args: list[str] | None = None,
        start_timeout_s: float = 300.0,
    ) -> None:
        super().__init__(log_path, port, start_timeout_s)
        self.model_dir = model_dir
        self.threads = threads
        self.extra_args = extra_args or []
        self._uds = f"/tmp/pytgi-bench-{os.getpid()}-{self.port}"

    @property
    def pid_path(self) -> Path:
        """Holds the launcher's pid (its process group) while it runs: a script that had to kill
        the benchmark can still stop the server, whose session is its own."""
        return self.log_path.with_suffix(".pid")

    def command(self) -> list[str]:
        # The console script sits next to the interpreter in a venv; a system interpreter's
        # user install puts it elsewhere (e.g. /usr/local/bin), where the module always works.
        script = Path(sys.executable).parent / "pytgi-launcher"
        module = [sys.executable, "-m", "pytgi_launcher.cli"]
        launcher = [str(script)] if script.exists() else module
        return [
            *launcher,
            "--model-id",
            str(self.model_dir),
            "--port",
            str(self.port),
            "--hostname",
            "127.0.0.1",
            "--shard-uds-path",
            self._uds,
            *self.extra_args,
        ]

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.threads is not None:
            # Every torch process of the server gets the same thread budget as in-process rows.
            env["OMP_NUM_THREADS"] = str(self.threads)
            env["MKL_NUM_THREADS"] = str(self.threads)
        return env

    def _started(self, process: subprocess.Popen[bytes]) -> None:
        self.pid_path.write_text(f"{process.pid}\n")

    def _stopped(self) -> None:
        self.pid_path.unlink(missing_ok=True)


def wait_compiled(server: PytgiServer, timeout_s: float = 1800.0) -> float:
    """Seconds until the server's shard logged its compiled steps done (or refused): they are
    compiled after Warmup, in the background, and a round must not time the eager fallback."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        text = server.log_path.read_text(errors="replace")
        if "compiled decode steps: batch sizes" in text or "compiled decode steps off" in text:
            return time.perf_counter() - start
        time.sleep(2.0)
    raise TimeoutError(f"no compiled decode steps after {timeout_s:.0f} s; see {server.log_path}")
