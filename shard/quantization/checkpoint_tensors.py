"""What the quantized formats read from a checkpoint, as a protocol of their own.

The loaders here are handed the checkpoint's `Weights` (pytgi_shard.weights.reader), which in
turn picks a loader from its LinearFormat: naming `Weights` here would make the two folders
import each other. They need only these reads, so they ask for them and `Weights` provides
them; the quantization folder then sits below `weights` in the shard's layering.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pytgi_shard.device.distributed import Dist


class CheckpointTensors(Protocol):
    """A checkpoint's tensors by name, read as this rank needs them (`Weights` implements it)."""

    dtype: torch.dtype
    dist: Dist

    def __contains__(self, name: object) -> bool: ...

    def shape(self, name: str) -> list[int]: ...

    def dtype_name(self, name: str) -> str: ...

    def get_tensor(self, name: str, *, cast: bool = True) -> torch.Tensor: ...

    def get_range(
        self, name: str, dim: int, start: int, stop: int, *, cast: bool = True
    ) -> torch.Tensor: ...

    def get_part(
        self, name: str, dim: int, index: int, parts: int, *, cast: bool = True
    ) -> torch.Tensor: ...

    def get_sharded(self, name: str, dim: int, *, cast: bool = True) -> torch.Tensor: ...
