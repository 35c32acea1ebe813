"""How long a step's forward took, without a host synchronisation of its own.

On CUDA the forward only queues work; waiting for it right after would stall the host while it
could already queue the token choice. CUDA events bracket the forward on the stream instead and
are read once the step has synchronised anyway (reading them then costs nothing). On the CPU the
forward runs synchronously and a wall clock measures it.
"""

from __future__ import annotations

import time

import torch


class ForwardTimer:
    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._start_ns = time.perf_counter_ns()
        self._stop_ns = self._start_ns
        if device.type == "cuda":
            stream = torch.cuda.current_stream(device)
            self._events = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            self._events[0].record(stream)

    def stop(self) -> None:
        """Marks the end of the forward (queued after its work on CUDA)."""
        if self._events is not None:
            self._events[1].record(torch.cuda.current_stream(self._device))
        else:
            self._stop_ns = time.perf_counter_ns()

    def elapsed_ns(self) -> int:
        """The forward's duration; on CUDA this waits for the forward to finish, which is free
        once the step has read its tokens back."""
        if self._events is None:
            return self._stop_ns - self._start_ns
        start, stop = self._events
        stop.synchronize()
        return int(start.elapsed_time(stop) * 1_000_000)
