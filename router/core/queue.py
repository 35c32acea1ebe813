"""The FIFO of requests waiting for KV blocks and a place in a step.

Strictly first-in first-out, like TGI's: admission (`step_plan.admit_newcomers`) takes entries
from the head while they fit and stops at the first that does not, so a large request at the
head waits for room instead of starving. A preempted request goes back to the head: it was
admitted before everyone waiting, and its stream is still open.
"""

from __future__ import annotations

from collections.abc import Iterator

from pytgi_router.core.request import Entry


class Queue:
    def __init__(self) -> None:
        # Insertion-ordered: O(1) removal of a cancelled entry, FIFO iteration for admission.
        self._entries: dict[int, Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._entries

    def __iter__(self) -> Iterator[Entry]:
        """Head first. Do not change the queue while iterating."""
        return iter(self._entries.values())

    def append(self, entry: Entry) -> None:
        self._entries[entry.id] = entry

    def push_front(self, entry: Entry) -> None:
        """Back to the head (a preempted entry). O(queue), and preemptions are rare."""
        self._entries = {entry.id: entry, **self._entries}

    def remove(self, entry_id: int) -> Entry | None:
        return self._entries.pop(entry_id, None)

    def drain(self) -> list[Entry]:
        """Empties the queue (shutdown); the entries hold no blocks."""
        entries = list(self._entries.values())
        self._entries.clear()
        return entries
