"""The interface every model speaks: a forward over a flat, paged batch."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pytgi_shard.attention.kv_cache import KVCache
from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.models.media_inputs import ImageLayout


class Model(ABC):
    """A causal LM on one rank. Tensor-parallel models all-reduce inside; logits come back whole."""

    # Per-rank shapes the engine needs to allocate the KV cache.
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    model_type: str
    max_position_embeddings: int
    # Whether positions index a learned table of max_position_embeddings rows (GPT-2's wpe): then
    # no position beyond it exists (rotary models extrapolate, learned tables cannot).
    learned_positions: bool = False
    # Sliding-window size when the model attends to a window only (Mistral); None otherwise.
    sliding_window: int | None = None
    # Whether a decode forward can be captured in a CUDA graph (with a capturable attention
    # backend): no host synchronisation, shapes that depend only on the number of tokens. pytgi's
    # own models are written so; the transformers fallback runs code it does not control.
    graph_capturable: bool = True
    # Why this model cannot keep an FP8 KV cache (--kv-cache-dtype); None: its attention layers
    # pass their scales to the backend (KVCache.scales_of), so it can.
    fp8_kv_refusal: str | None = None
    # A vision-language model's reading of its wire images (shard/models/media_inputs.py: their
    # grids, pixel shapes and token counts; M-RoPE or 1-D positions); None: the model takes no
    # images and the shard refuses them.
    image_layout: ImageLayout | None = None

    def warmup_images(self) -> None:
        """Runs what the largest image a request may carry costs (a vision tower's forward),
        so that Warmup's peak, which sizes the KV cache, includes it; nothing for a text model."""
        return None

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        lm_head_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Runs the flat batch and returns float32 logits [len(lm_head_indices), vocab_size].

        input_ids, positions: [num_tokens]. lm_head_indices selects which of the flat tokens need
        logits (the last token of each request, or every prompt token for prefill logprobs);
        None means all of them. The K/V of every token is written to `kv_cache` at
        `meta.slot_mapping`.
        """
