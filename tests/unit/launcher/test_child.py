"""Supervised children: output streaming, exit descriptions, group stop, death with the parent."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from pytgi_launcher.child import ChildProcess
from pytgi_launcher.logs import LogSink


def python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_output_is_streamed_with_a_prefix_and_kept_as_tail() -> None:
    out = io.StringIO()
    child = ChildProcess("shard-3", python("""
        import sys
        print("hello")
        print("oops", file=sys.stderr)
        sys.exit(3)
    """), os.environ, LogSink(False, out))
    assert child.wait(30) == 3
    child.flush_log(5)
    assert child.exit_description() == "exited with code 3"
    assert list(child.tail) == ["hello", "oops"]
    assert "[shard-3] hello" in out.getvalue() and "[shard-3] oops" in out.getvalue()


def test_json_sink_tags_child_lines() -> None:
    out = io.StringIO()
    child = ChildProcess("router", python("""
        import json
        print(json.dumps({"level": "INFO", "message": "up"}))
        print("Traceback (most recent call last):")
    """), os.environ, LogSink(True, out))
    child.wait(30)
    child.flush_log(5)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[0] == {"level": "INFO", "message": "up", "process": "router"}
    assert lines[1]["message"] == "Traceback (most recent call last):"
    assert lines[1]["process"] == "router" and "timestamp" in lines[1]


def test_killed_child_is_described_by_signal() -> None:
    child = ChildProcess("shard-0", python("import time; time.sleep(60)"), os.environ,
                         LogSink(False, io.StringIO()))
    os.kill(child.pid, signal.SIGKILL)
    child.wait(10)
    assert child.exit_description() == "was killed by SIGKILL"


def test_stop_escalates_and_takes_the_whole_group() -> None:
    child = ChildProcess("shard-0", python("""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(grandchild.pid, flush=True)
        time.sleep(60)
    """), os.environ, LogSink(False, io.StringIO()))
    deadline = time.monotonic() + 30
    while not child.tail and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(child.tail[0])
    assert os.getpgid(child.pid) == child.pid, "the child leads its own process group"
    started = time.monotonic()
    assert child.stop(grace=0.5) == -signal.SIGKILL
    assert time.monotonic() - started < 10
    assert wait_gone(grandchild)


def test_children_die_with_a_sigkilled_launcher(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG: even SIGKILL of the launcher (no handler can run) leaves no orphan."""
    launcher = subprocess.Popen(python("""
        import io, os, sys, time
        from pytgi_launcher.child import ChildProcess
        from pytgi_launcher.logs import LogSink
        child = ChildProcess("shard-0", [sys.executable, "-c", "import time; time.sleep(60)"],
                             os.environ, LogSink(False, io.StringIO()))
        print(child.pid, flush=True)
        time.sleep(60)
    """), stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    child_pid = int(launcher.stdout.readline())
    assert alive(child_pid)
    launcher.kill()
    launcher.wait()
    assert wait_gone(child_pid), "the child outlived its SIGKILLed launcher"
