"""ServerProcess, the child-server life PytgiServer and LlamaCppServer share, on a real child
(a Python HTTP server): ready once /health answers 200, stopped with its whole session on exit;
a child that dies while starting fails in one error that carries its log's tail."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

from pytgi_bench.compare.llama_cpp_server import LlamaCppServer
from pytgi_bench.compare.server_process import ServerProcess, ServerStartError

HEALTHY = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


class PythonServer(ServerProcess):
    name = "python-server"
    poll_s = 0.05

    def __init__(self, log_path: Path, script: str) -> None:
        super().__init__(log_path, None, start_timeout_s=30.0)
        self.script = script

    def command(self) -> list[str]:
        return [sys.executable, "-c", self.script, str(self.port)]


def test_ready_on_health_and_stopped_on_exit(tmp_path: Path) -> None:
    with PythonServer(tmp_path / "server.log", HEALTHY) as server:
        assert server.startup_s is not None and server.startup_s > 0
        assert httpx.get(f"{server.url}/health").status_code == 200
        process = server._process
        assert process is not None
    assert process.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(process.pid, 0)
    assert "serving" in (tmp_path / "server.log").read_text()


def test_a_child_that_dies_while_starting_is_one_error_with_its_log(tmp_path: Path) -> None:
    script = "import sys; print('bad flag --nope'); sys.exit(3)"
    with pytest.raises(ServerStartError,
                       match=r"(?s)python-server exited with code 3 while starting.*bad flag"):
        PythonServer(tmp_path / "dead.log", script).start()


def test_llama_cpp_server_is_a_server_process(tmp_path: Path) -> None:
    server = LlamaCppServer(Path("/bin/false"), tmp_path / "m.gguf", tmp_path / "l.log", ["-t", "2"])
    assert server.command() == ["/bin/false", "-m", str(tmp_path / "m.gguf"), "--host",
                                "127.0.0.1", "--port", str(server.port), "-t", "2"]
    with pytest.raises(ServerStartError, match="llama-server exited with code 1"):
        server.start()
