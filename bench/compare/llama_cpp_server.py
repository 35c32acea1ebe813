"""llama.cpp's `llama-server` in a child process for `pytgi_bench.compare.llama_cpp`: ready when
/health answers 200, stopped (SIGTERM, then SIGKILL) on exit; its log goes to a file shown on
failure (`server_process.ServerProcess`, as `server_process.PytgiServer`)."""

from __future__ import annotations

from pathlib import Path

from pytgi_bench.compare.server_process import ServerProcess

# The best of seven settings on two cores: 64 slots of 256 tokens (the demo model's
# context), continuous batching, two threads.
DEFAULT_ARGS = ("-np", "64", "-c", "16384", "--cont-batching", "-t", "2")


class LlamaCppServer(ServerProcess):
    """`with LlamaCppServer(binary, gguf, log) as server:` ... `server.url`."""

    name = "llama-server"
    poll_s = 0.2
    stop_timeout_s = 15.0

    def __init__(self, binary: Path, model: Path, log_path: Path, args: list[str],
                 start_timeout_s: float = 120.0) -> None:
        super().__init__(log_path, None, start_timeout_s)
        self.binary = binary
        self.model = model
        self.args = args

    def command(self) -> list[str]:
        return [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1",
                "--port", str(self.port), *self.args]
