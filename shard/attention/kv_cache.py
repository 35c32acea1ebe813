"""The paged KV cache: one preallocated key and value tensor per layer, in fixed-size blocks.

The router owns the allocator (which blocks belong to which request); the shard owns this memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Block 0 is never handed out by the router: the slot that writes no request's KV goes there
# (padded rows of a CUDA graph, a look-ahead row with no slot left, the Health forward).
SCRATCH_SLOT = 0


@dataclass
class KVCache:
    # Per layer: [num_blocks, block_size, num_kv_heads, head_dim].
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(keys=keys, values=values)

    @property
    def num_blocks(self) -> int:
        return int(self.keys[0].shape[0]) if self.keys else 0

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one token of context costs on this rank (keys and values, every layer)."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * element
