"""One supervised child process (a shard or the router): spawn, stream its log, stop it.

Each child leads its own process group, so a terminal's Ctrl-C reaches only the launcher (which
then stops the children in order) and a stop signal reaches everything the child started. On
Linux the child also asks the kernel to SIGKILL it when the launcher dies (PR_SET_PDEATHSIG), so
even a SIGKILLed launcher leaves no orphan serving on a GPU.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Mapping, Sequence

from pytgi_launcher.logs import LogSink

TAIL_LINES = 40


class ChildProcess:
    """A running child; its output goes line by line to the sink and into a tail buffer."""

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str], sink: LogSink):
        self.name = name
        self.argv = list(argv)
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._sink = sink
        # The exec shim arms PDEATHSIG and then becomes argv (see exec_child.py for why not a
        # preexec_fn). Spawned from the main thread only: PDEATHSIG fires when the spawning
        # *thread* exits. A new session makes the child lead its own process group.
        shim = [sys.executable, "-m", "pytgi_launcher.exec_child", str(os.getpid())]
        self.popen = subprocess.Popen(
            shim + self.argv,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
        self.pid = self.popen.pid
        self._reader = threading.Thread(target=self._pump, name=f"log-{name}", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        stream = self.popen.stdout
        assert stream is not None
        for raw in stream:
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            self.tail.append(line)
            self._sink.child_line(self.name, line)
        stream.close()

    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def terminate(self) -> None:
        self.signal_group(signal.SIGTERM)

    def kill(self) -> None:
        self.signal_group(signal.SIGKILL)

    def wait(self, timeout: float | None) -> int | None:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace: float) -> int:
        """SIGTERM, up to `grace` seconds, then SIGKILL; always reaps the whole group."""
        if self.alive():
            self.terminate()
            if self.wait(grace) is None:
                self.kill()
        code = self.popen.wait()
        self.kill()  # anything the child left behind in its group
        self.flush_log(1.0)
        return code

    def flush_log(self, timeout: float) -> None:
        """Waits briefly for the reader to reach end of output, so the tail is complete."""
        self._reader.join(timeout)

    def exit_description(self) -> str:
        code = self.popen.poll()
        if code is None:
            return "is running"
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def last_lines(self, count: int = 15) -> str:
        lines = list(self.tail)[-count:]
        return "\n".join(f"  {line}" for line in lines) if lines else "  (no output)"
