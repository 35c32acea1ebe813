"""A real `pytgi-router` process for integration tests: started on a free port, stopped by signal."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

READY = re.compile(r"Connected, serving on (http://\S+)")
ROUTER = str(Path(sys.executable).with_name("pytgi-router"))


def no_drain_grace(flags: tuple[str, ...] | list[str]) -> list[str]:
    """`--drain-grace-seconds 0` unless `flags` set it (router or launcher flags): the default
    grace (5 s of /health 503 before the router stops admitting) would be waited out by every
    test's stop; the tests of the grace itself (test_http_api, the replica gateways) set it."""
    return [] if "--drain-grace-seconds" in flags else ["--drain-grace-seconds", "0"]


# TGI's default prefill budget, for the routers whose test does not set one: unset, the shards
# measure it at every Warmup (a ladder of prefills, 1-3 s per start on CI's two cores, and a
# budget that moves with the machine's load); test_http_api's zero-config test measures it.
PREFILL_TOKENS = "4096"


def default_flags(flags: tuple[str, ...], measure_prefill: bool) -> list[str]:
    """The flags every test router (or launcher) gets unless `flags` set them: no drain grace,
    and (unless `measure_prefill`) a fixed prefill budget."""
    fixed = measure_prefill or "--max-batch-prefill-tokens" in flags
    return [*no_drain_grace(flags), *([] if fixed else ["--max-batch-prefill-tokens",
                                                        PREFILL_TOKENS])]


class RouterProcess:
    """`RouterProcess(shard, tokenizer_dir, *flags)`; `shard` is a socket path or host:port;
    `measure_prefill`: the shards measure the prefill budget, as they do for a user who sets
    none (default_flags)."""

    def __init__(
        self, shard: str, tokenizer_dir: Path | str, *flags: str,
        env: dict[str, str] | None = None, timeout: float = 60.0, measure_prefill: bool = False,
    ) -> None:
        target = ["--master-shard-address", shard] if ":" in shard and not shard.startswith(
            ("/", "unix:")) else ["--master-shard-uds-path", shard]
        self.argv = [ROUTER, *target, "--tokenizer-name", str(tokenizer_dir),
                     "--hostname", "127.0.0.1", "--port", "0",
                     *default_flags(flags, measure_prefill), *flags]
        self.env = {**os.environ, **(env or {})}
        self.timeout = timeout
        self.lines: list[str] = []
        self.url = ""
        self.proc: subprocess.Popen[str] | None = None
        self._ready = threading.Event()

    def start(self) -> RouterProcess:
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env
        )
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + self.timeout
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("pytgi-router did not start:\n" + self.output)
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            m = READY.search(line)
            if m:
                self.url = m.group(1)
                self._ready.set()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def logged(self, text: str, timeout: float = 10.0) -> bool:
        """Whether the router's output has `text`, waiting for it up to `timeout`: a line the
        router logged before answering may still be in the pipe when the answer arrives."""
        deadline = time.monotonic() + timeout
        while text not in self.output:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then the exit code (SIGKILL if it does not exit in time)."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> RouterProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self.kill()
