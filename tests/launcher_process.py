"""A real `pytgi-launcher` process for tests, on free ports and a private socket directory, plus
/proc readers to check which processes it started and that none outlives it.

    launcher = Launcher("--model-id", str(model), "--num-shard", "2").wait_ready()
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.router_process import default_flags

START_TIMEOUT = 180.0
# One intra-op thread per process the launcher starts, as tests/shard_process.py gives its
# shards: on CI's two cores, shared with the other test worker, a shard's torch threads spin
# waiting for each other on tiny tensors (several times the work's time).
CHILD_THREADS = {"OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def assert_all_gone(pids: set[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "orphan processes left behind"


class Launcher:
    """A `pytgi-launcher` process on free ports and a private socket directory."""

    def __init__(
        self, *flags: str, env: dict[str, str] | None = None, private: bool = True,
        measure_prefill: bool = False,
    ) -> None:
        """`private=False`: the launcher's own default socket path and rendezvous port (derived
        from the HTTP port / picked free) instead of a private directory and a free port.
        `measure_prefill`: the shards measure the prefill budget, as for a user who sets none
        (else a fixed one, tests/router_process.py's default_flags)."""
        # Unix socket paths must stay short (~107 bytes): not under pytest's deep tmp_path.
        self.workdir = Path(tempfile.mkdtemp(prefix="pytgi-l-", dir="/tmp"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.uds = str(self.workdir / "s") if private else f"/tmp/text-generation-server-{self.port}"
        own = ["--shard-uds-path", self.uds, "--master-port", str(free_port())] if private else []
        argv = [sys.executable, "-m", "pytgi_launcher.cli", "--hostname", "127.0.0.1",
                "--port", str(self.port), *own, "--graceful-termination-timeout", "20",
                *default_flags(flags, measure_prefill), *flags]
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1",
                                          **CHILD_THREADS, **(env or {})})
        threading.Thread(target=self._read, daemon=True).start()
        self.children: set[int] = set()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if "ready: http://" in line:
                self.ready.set()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_ready(self) -> Launcher:
        deadline = time.monotonic() + START_TIMEOUT
        while not self.ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise AssertionError(f"launcher did not become ready:\n{self.output}")
        self.children = descendants(self.proc.pid)
        return self

    def wait(self, timeout: float = 60.0) -> int:
        code = self.proc.wait(timeout)
        time.sleep(0.2)  # the reader thread drains the last lines
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


def child_pid(launcher: Launcher, name: str, latest: bool = False) -> int:
    """The pid the launcher logged for `name` ("shard 1", "router"): the first one, or with
    `latest` the last (a restarted shard)."""
    for line in reversed(launcher.lines) if latest else list(launcher.lines):
        text = line
        if line.startswith("{"):
            text = json.loads(line).get("message", "")
        if f"started {name} (pid " in text:
            return int(text.split("(pid ", 1)[1].split(")", 1)[0])
    raise AssertionError(f"no pid logged for {name}:\n{launcher.output}")
