"""Tensor-parallel communication between the shards of one model: NCCL on CUDA, gloo on CPU."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as tdist
from torch.distributed import ProcessGroup

from pytgi_shard.device.capabilities import DeviceCapabilities, probe_capabilities

# A rank that never joins must not hang its peers forever: the launcher reports the failure instead.
INIT_TIMEOUT = timedelta(seconds=120)


@dataclass
class Dist:
    """This process's place in the tensor-parallel group. world_size 1 needs no process group."""

    rank: int
    world_size: int
    device: torch.device
    group: ProcessGroup | None
    # What the device runs (device/capabilities.py), resolved once at start-up and read by
    # every layer built for this rank; None: probed from `device` with custom kernels allowed
    # (tests, tools).
    caps: DeviceCapabilities = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.caps is None:
            self.caps = probe_capabilities(self.device)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums `t` over all ranks, in place; returns it."""
        if self.world_size > 1:
            tdist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenates every rank's `t` (same shape on each) along `dim`, in rank order."""
        if self.world_size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        tdist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=dim)

    def close(self) -> None:
        """Tears the process group down (at shutdown), so peers see a clean exit, not a hang."""
        if self.group is not None and tdist.is_initialized():
            tdist.destroy_process_group()
            self.group = None


def init_distributed(
    rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device,
    caps: DeviceCapabilities | None = None,
) -> Dist:  # fmt: skip
    """Joins the group of `world_size` shards rendezvousing at master_addr:master_port; `caps`
    None: probed from `device`."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    if world_size == 1:
        return single_process(device, caps)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tdist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=INIT_TIMEOUT,
    )
    group = tdist.group.WORLD
    assert group is not None
    return Dist(rank, world_size, device, group, caps or probe_capabilities(device))


def single_process(device: torch.device, caps: DeviceCapabilities | None = None) -> Dist:
    """A world of one: every collective is a no-op (tests, tools, --num-shard 1); `caps` None:
    probed from `device`."""
    return Dist(0, 1, device, None, caps or probe_capabilities(device))
