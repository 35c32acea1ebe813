"""llama.cpp's `llama-server` in a child process for `pytgi_bench.compare.llama_cpp`: ready when
/health answers 200, stopped (SIGTERM, then SIGKILL) on exit; its log goes to a file shown on
failure. The counterpart of `server_process.PytgiServer`."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType

import httpx

from pytgi_bench.compare.server_process import ServerStartError, free_port

# The best of seven settings on two cores: 64 slots of 256 tokens (the demo model's
# context), continuous batching, two threads.
DEFAULT_ARGS = ("-np", "64", "-c", "16384", "--cont-batching", "-t", "2")


class LlamaCppServer:
    """`with LlamaCppServer(binary, gguf, log) as server:` ... `server.url`."""

    def __init__(self, binary: Path, model: Path, log_path: Path, args: list[str],
                 start_timeout_s: float = 120.0) -> None:
        self.binary = binary
        self.model = model
        self.log_path = log_path
        self.args = args
        self.port = free_port()
        self.start_timeout_s = start_timeout_s
        self.startup_s: float | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1",
                "--port", str(self.port), *self.args]

    def start(self) -> LlamaCppServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(self.command(), stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True)
        started = time.perf_counter()
        while time.perf_counter() < started + self.start_timeout_s:
            if self._process.poll() is not None:
                raise ServerStartError(f"llama-server exited with code "
                                       f"{self._process.returncode}; log {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    self.startup_s = time.perf_counter() - started
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise ServerStartError(f"llama-server was not healthy after {self.start_timeout_s:.0f} s; "
                               f"log {self.log_path}")

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def __enter__(self) -> LlamaCppServer:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
