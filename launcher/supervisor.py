"""Starts the shards, then the router, and watches them until a signal or a death.

Start-up: all N shards at once (they rendezvous with each other), each waited for until its gRPC
health says SERVING for this launch's instance id (`--shard-startup-timeout`): a server of another
instance on the same socket path never counts; then the router, which connects to rank 0 and runs
Warmup before its /health turns 200 (same timeout). Afterwards, every 100 ms: a shard that exits
makes the launcher restart the whole shard group (`--max-shard-restarts`, with backoff; see
restart.py) while the router stays up and reconnects; a router that exits, or a shard death with
no restart left, stops everything and the launcher exits 1, naming the child and quoting its last
lines.
SIGINT/SIGTERM: the router is sent SIGTERM first (not ready for `--drain-grace-seconds`, then it
drains in-flight requests), then the shards; the router gets both periods, the shards
`--graceful-termination-timeout` seconds, before SIGKILL; the launcher exits 0. A second
signal skips the waiting. Whatever happens, no child outlives the launcher.
"""

from __future__ import annotations

import atexit
import logging
import signal
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from pytgi_launcher.child import ChildProcess
from pytgi_launcher.commands import router_argv, router_env, shard_argv, shard_env
from pytgi_launcher.logs import LogSink
from pytgi_launcher.readiness import local_url, router_healthy, shard_serving, shard_target
from pytgi_launcher.restart import RestartPolicy
from pytgi_launcher.settings import LauncherSettings
from pytgi_shard.service.serving_state import instance_service

POLL_SECONDS = 0.1
PROGRESS_SECONDS = 10.0
# After a child died nothing is worth draining for long: the others get this much grace.
FAILURE_GRACE = 10.0
# Survivors of a group that lost a rank are stuck in collectives, deaf to SIGTERM: brief grace.
RESTART_GRACE = 5.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class LaunchFailed(Exception):
    """A child died or never became ready; the message says which and why."""


class ChildDied(LaunchFailed):
    def __init__(self, child: ChildProcess, message: str) -> None:
        super().__init__(message)
        self.child = child


@dataclass
class Plan:
    """What to start: resolved once by `launch` before anything is spawned."""

    settings: LauncherSettings
    model_path: Path
    num_shard: int
    dtype: str
    compute_type: str
    environ: Mapping[str, str] = field(default_factory=dict)
    # The rendezvous port resolved at launch (--master-port, else a free one).
    master_port: int | None = None
    # What the weights run as, for the ready line ("no quantization", "quantization gptq ...").
    quantization: str = "no quantization"
    # This launch's id: its shards answer the health service pytgi.instance.<id>, which no other
    # instance's shard does, so readiness never counts a stranger on the same socket path.
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)


class Supervisor:
    def __init__(self, plan: Plan, sink: LogSink, log: logging.Logger) -> None:
        self.plan = plan
        self.sink = sink
        self.log = log
        self.shards: list[ChildProcess] = []
        self.router: ChildProcess | None = None
        self.restarts = RestartPolicy(plan.settings.max_shard_restarts)
        # time.monotonic() when the current shard group became ready.
        self._shards_up_since = 0.0
        self._stop = threading.Event()
        self._signals = 0

    # ---- signals ------------------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._signals += 1
        if self._signals == 1:
            self.log.info("received %s: shutting down", signal.Signals(signum).name)
        else:
            self.log.warning("received %s again: stopping now", signal.Signals(signum).name)
        self._stop.set()

    def _install_signal_handlers(self) -> Callable[[], None]:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

        return restore

    # ---- lifecycle ----------------------------------------------------------------------------

    def run(self) -> int:
        restore = self._install_signal_handlers()
        atexit.register(self.kill_all)
        try:
            return self._run()
        except LaunchFailed as e:
            self.log.error("%s", e)
            self.stop_all(FAILURE_GRACE)
            return 1
        finally:
            self.kill_all()
            atexit.unregister(self.kill_all)
            restore()

    def _run(self) -> int:
        self._start_shards()
        if not self._wait_ready(self.shards, self._shard_ready, "shard"):
            return self._shutdown()
        self._shards_up_since = time.monotonic()
        self._start_router()
        assert self.router is not None
        if not self._wait_ready([self.router], lambda _c: self._router_ready(), "router"):
            return self._shutdown()
        s = self.plan.settings
        self.log.info(
            "ready: %s serving %s on %d shard(s) as %s, %s",
            local_url(s.hostname, s.port), s.model_id, self.plan.num_shard, self.plan.dtype,
            self.plan.quantization,
        )
        while not self._stop.wait(POLL_SECONDS):
            try:
                self._check_alive()
            except ChildDied as death:
                if death.child not in self.shards:
                    raise
                self._restart_shards(death.child)
        return self._shutdown()

    def _restart_shards(self, dead: ChildProcess) -> None:
        """Restarts the whole group after `dead` died, as long as the policy allows; raises
        LaunchFailed when it does not (or the router dies meanwhile)."""
        limit = self.plan.settings.max_shard_restarts
        while True:
            what = f"{_title(dead.name)} {dead.exit_description()}"
            delay = self.restarts.next_delay(time.monotonic() - self._shards_up_since)
            if delay is None:
                raise LaunchFailed(
                    f"{what} and no shard restart is left (--max-shard-restarts={limit}); the "
                    f"other processes were stopped. Last lines of its log:\n{dead.last_lines()}"
                )
            self.log.warning(
                "%s; restarting the shard group in %gs (restart %d of %d), the router stays up. "
                "Last lines of its log:\n%s",
                what, delay, self.restarts.used, limit, dead.last_lines(),
            )
            self._stop_group(self.shards, RESTART_GRACE)
            self.shards = []
            if self._stop.wait(delay):
                return
            self._start_shards()
            try:
                if not self._wait_ready(self.shards, self._shard_ready, "shard"):
                    return
            except ChildDied as death:
                if death.child not in self.shards:
                    raise
                dead = death.child
                continue
            self._shards_up_since = time.monotonic()
            self.log.info("shard group restarted: the router reconnects to it")
            return

    def _start_shards(self) -> None:
        p = self.plan
        for rank in range(p.num_shard):
            argv = shard_argv(p.settings, p.model_path, rank, p.num_shard, p.dtype,
                              p.master_port, p.instance_id)
            env = shard_env(p.settings, p.environ, rank, p.num_shard, p.master_port)
            child = self._spawn(f"shard-{rank}", argv, env)
            self.log.info("started shard %d (pid %d) of %d", rank, child.pid, p.num_shard)
            self.shards.append(child)

    def _start_router(self) -> None:
        p = self.plan
        env = router_env(p.settings, p.environ, p.compute_type)
        self.router = self._spawn("router", router_argv(p.settings, p.model_path), env)
        self.log.info("started router (pid %d), waiting for warmup", self.router.pid)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> ChildProcess:
        try:
            return ChildProcess(name, argv, env, self.sink)
        except OSError as e:
            raise LaunchFailed(f"cannot start {_title(name)} ({argv[0]}): {e}") from e

    def _shard_ready(self, child: ChildProcess) -> bool:
        rank = self.shards.index(child)
        target = shard_target(self.plan.settings.shard_socket(rank))
        return shard_serving(target, instance_service(self.plan.instance_id))

    def _router_ready(self) -> bool:
        s = self.plan.settings
        return router_healthy(local_url(s.hostname, s.port))

    def _wait_ready(
        self, children: list[ChildProcess], ready: Callable[[ChildProcess], bool], what: str
    ) -> bool:
        """True when all are ready; False on a stop signal; LaunchFailed on death or timeout."""
        timeout = self.plan.settings.shard_startup_timeout
        started = time.monotonic()
        next_progress = started + PROGRESS_SECONDS
        pending = list(children)
        while pending:
            if self._stop.is_set():
                return False
            self._check_alive(during_startup=True)
            pending = [c for c in pending if not ready(c)]
            now = time.monotonic()
            if pending and now - started > timeout:
                worst = pending[0]
                worst.flush_log(0.5)
                raise LaunchFailed(
                    f"{_title(worst.name)} did not become ready within {timeout:g}s "
                    f"(--shard-startup-timeout); last lines of its log:\n{worst.last_lines()}"
                )
            if pending and now >= next_progress:
                names = ", ".join(c.name for c in pending)
                self.log.info("waiting for %s to be ready (%ds): %s", what, now - started, names)
                next_progress = now + PROGRESS_SECONDS
            if pending:
                self._stop.wait(POLL_SECONDS)
        for child in children:
            self.log.info("%s is ready", child.name)
        return True

    def _check_alive(self, during_startup: bool = False) -> None:
        for child in self._children():
            if not child.alive():
                child.flush_log(1.0)
                when = " during start-up" if during_startup else ""
                raise ChildDied(
                    child,
                    f"{_title(child.name)} {child.exit_description()}{when}; the other processes "
                    f"were stopped. Last lines of its log:\n{child.last_lines()}"
                )

    def _children(self) -> list[ChildProcess]:
        return [*self.shards, *([self.router] if self.router else [])]

    def _shutdown(self) -> int:
        """The signal path: router first (it drains), then the shards; exit 0."""
        s = self.plan.settings
        grace = s.graceful_termination_timeout
        if self.router is not None:
            # The router's own not-ready period comes before its drain: both are its grace.
            self._stop_group([self.router], s.drain_grace_seconds + grace)
        self._stop_group(self.shards, grace)
        self.log.info("all processes stopped")
        return 0

    def _stop_group(self, children: list[ChildProcess], grace: float) -> None:
        for child in children:
            if child.alive():
                child.terminate()
        deadline = time.monotonic() + grace
        while any(c.alive() for c in children) and time.monotonic() < deadline:
            if self._signals > 1:
                break
            time.sleep(POLL_SECONDS)
        for child in children:
            if child.alive():
                self.log.warning("%s did not stop in time: killing it", child.name)
            code = child.stop(0.0)
            self.log.info("%s %s", child.name, _exit_words(code))

    def stop_all(self, grace: float) -> None:
        if self.router is not None:
            self._stop_group([self.router], grace)
        self._stop_group(self.shards, grace)

    def kill_all(self) -> None:
        """Last resort on every exit path (exceptions, atexit): SIGKILL every child's group."""
        for child in self._children():
            child.kill()


def _title(name: str) -> str:
    """'shard-1' -> 'shard 1', 'router' -> 'router': how messages name a child."""
    return name.replace("-", " ")


def _exit_words(code: int) -> str:
    if code < 0:
        try:
            return f"stopped ({signal.Signals(-code).name})"
        except ValueError:
            return f"stopped (signal {-code})"
    return f"exited with code {code}"
