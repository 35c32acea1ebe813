"""Decode attention written for a compiler: the scores and the output as reductions that read
the paged cache through the block table, with no gathered context in between.

The reference backend gathers each request's blocks into a padded [batch, context] copy of the
keys and values, then calls SDPA over it: in eager PyTorch that is the fastest way, since the
copy is one index_select and SDPA one fused kernel. Inside a compiled step (--cpu-graphs,
shard/engine/cpu_graphs.py) SDPA stays an opaque kernel, so the copy stays too: every decode
step writes the whole context once more and reads it twice. At batch 64 over 128 positions
that context (6 MB a layer on the demo model) is past a small CPU's L3, and the attention was
most of the step. Written as an elementwise product and a sum, the gather becomes the
reductions' own indirect loads, and inductor generates one loop per reduction that streams the
cache once (measured per layer, 2 threads: 1.87 -> 0.78 ms at batch 64 over 128 positions,
0.087 -> 0.050 ms at batch 1). Eagerly the same ops would materialise a [batch, context, heads,
head_dim] product, so the backend takes this path only when the metadata says the forward is
being compiled (AttentionMetadata.compiled).
"""

from __future__ import annotations

import torch

from pytgi_shard.attention.kv_quant import KVScales, dequantize


def attend_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    blocks: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
    kv_scales: KVScales | None = None,
) -> torch.Tensor:
    """[B, Hq, D]: one query per request, q [B, Hq, D], attending the context in `blocks`
    ([B, blocks] of the caches [num_blocks, block_size, Hkv, D]) where `allowed` ([B, context]
    bool) lets it, or with ALiBi's additive `bias` ([B, Hkv, group, context], -inf where not
    allowed) instead. Scores and softmax as the reference backend's SDPA computes them
    (soft-capped as its Gemma 2 path does; an FP8 cache dequantized as it is read)."""
    batch, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = blocks.shape[1], key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    keys = _blocks(key_cache, blocks, None if kv_scales is None else kv_scales.key, q.dtype)
    values = _blocks(value_cache, blocks, None if kv_scales is None else kv_scales.value,
                     q.dtype)
    # [B, blocks, block_size, Hkv, group]: each query head's score of each position. Kept in
    # blocks (not flattened to the context) so the compiler indexes the cache directly.
    grouped = _materialized(q).view(batch, 1, 1, num_kv_heads, group, head_dim)
    scores = (grouped * keys.unsqueeze(4)).sum(-1) * scale
    scores = scores.view(batch, num_blocks * block_size, num_kv_heads, group)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is None:
        scores = scores.masked_fill(~allowed.view(batch, -1, 1, 1), float("-inf"))
    else:
        scores = scores + bias.permute(0, 3, 1, 2)
    weights = torch.softmax(scores, dim=1, dtype=torch.float32).to(q.dtype)
    weights = weights.view(batch, num_blocks, block_size, num_kv_heads, group, 1)
    out = (weights * values.unsqueeze(4)).sum(dim=(1, 2))  # [B, Hkv, group, D]
    return out.reshape(batch, num_heads, head_dim)


def _blocks(
    cache: torch.Tensor, blocks: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """[B, blocks, block_size, Hkv, D]: the cache read through the block table (an indexing
    the compiler fuses into its consumers' loads), dequantized when the cache is FP8."""
    read = cache[blocks]
    return read if scale is None else dequantize(read, scale, dtype)


def _materialized(q: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `q` that the compiler must store before the scores read it. Left to
    its own heuristics, inductor inlined q's producer (the rotary embedding, a cos per element)
    into the scores' loop, recomputing it for every context position: 23 ms a batch-64 step
    where the stored q gives 16 ms (measured). as_strided needs its input in memory, so its
    lowering stores it. It is given a copy, not `q`: q may be a view into the fused QKV
    projection (BLOOM's), whose storage inductor lays out as it likes, and as_strided's strides
    and offset address the storage, so over a view they read elsewhere than eager's."""
    copy = q.clone(memory_format=torch.contiguous_format)
    return torch.as_strided(copy, copy.shape, copy.stride(), 0)
