"""The paged KV cache: one preallocated key and value tensor per layer, in fixed-size blocks.

The router owns the allocator (which blocks belong to which request); the shard owns this memory.
An FP8 cache (--kv-cache-dtype) stores its tensors in an FP8 dtype and carries each layer's
scales (shard/attention/kv_quant.py), which every backend reads and writes it with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pytgi_shard.attention.kv_quant import KVScales, is_fp8

# Block 0 is never handed out by the router: the slot that writes no request's KV goes there
# (padded rows of a CUDA graph, a look-ahead row with no slot left, the Health forward).
SCRATCH_SLOT = 0


@dataclass
class KVCache:
    # Per layer: [num_blocks, block_size, num_kv_heads, head_dim].
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    # Per layer, for an FP8 cache; None for a cache in the model's dtype.
    scales: list[KVScales] | None = None

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
        scales: list[KVScales] | None = None,
    ) -> KVCache:
        """`scales`: one per layer, required for an FP8 `dtype` and refused otherwise."""
        if is_fp8(dtype) != (scales is not None):
            raise ValueError(f"a {dtype} KV cache takes per-layer scales exactly when it is FP8")
        if scales is not None and len(scales) != num_layers:
            raise ValueError(f"{len(scales)} KV scales for {num_layers} layers")
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(keys=keys, values=values, scales=scales)

    @property
    def num_blocks(self) -> int:
        return int(self.keys[0].shape[0]) if self.keys else 0

    def scales_of(self, layer: int) -> KVScales | None:
        """Layer `layer`'s scales, which its attention passes the backend; None unquantized."""
        return None if self.scales is None else self.scales[layer]

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one token of context costs on this rank (keys and values, every layer)."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * element
