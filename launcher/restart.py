"""When the launcher may restart a shard group that lost a rank, and after how long.

A tensor-parallel group is only as alive as its weakest rank (the others block in collectives),
so the whole group restarts together; the router stays up and reconnects. Restarts are bounded
(`--max-shard-restarts`; 0 is TGI's behaviour: any death stops everything) and spaced by an
exponential backoff, so a shard that crashes at once on every start (bad weights, a GPU fault)
ends the launcher instead of looping. A group that then serves for `reset_after_s` has shown the
crash was a one-off: its restart budget is whole again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BASE_DELAY_S = 1.0
MAX_DELAY_S = 30.0
RESET_AFTER_S = 600.0


@dataclass
class RestartPolicy:
    max_restarts: int
    base_delay_s: float = BASE_DELAY_S
    max_delay_s: float = MAX_DELAY_S
    reset_after_s: float = RESET_AFTER_S
    used: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")

    def next_delay(self, served_s: float) -> float | None:
        """A rank died after the group had served `served_s` seconds: the delay before the
        next restart, or None when no restart is left. Counts the restart."""
        if served_s >= self.reset_after_s:
            self.used = 0
        if self.used >= self.max_restarts:
            return None
        delay = min(self.max_delay_s, self.base_delay_s * 2.0**self.used)
        self.used += 1
        return delay
