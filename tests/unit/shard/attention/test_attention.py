"""The reference paged attention against a naive dense causal attention on random inputs."""

from __future__ import annotations

import random

import pytest
import torch

from pytgi_shard.attention import AttentionMetadata, get_backend


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, scale: float,
    window: int | None,
) -> torch.Tensor:
    """One request, the obvious way: q [n, Hq, D] at positions first.., k/v [ctx, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    qpos = torch.arange(q.shape[0]).view(-1, 1) + first
    kpos = torch.arange(k.shape[0]).view(1, -1)
    allowed = kpos <= qpos
    if window is not None:
        allowed &= qpos - kpos < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


def run_case(
    cached: list[int], new: list[int], heads: int, kv_heads: int, block_size: int,
    window: int | None, seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    dim = 8
    needed = [-(-(c + n) // block_size) for c, n in zip(cached, new, strict=True)]
    num_blocks = sum(needed) + 3
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in needed]
    key_cache = torch.zeros(num_blocks, block_size, kv_heads, dim)
    value_cache = torch.zeros_like(key_cache)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    # The cached prefix of each request is already in its blocks.
    prefix_k = [randn(c, kv_heads, dim) for c in cached]
    prefix_v = [randn(c, kv_heads, dim) for c in cached]
    for table, pk, pv in zip(tables, prefix_k, prefix_v, strict=True):
        for p in range(pk.shape[0]):
            key_cache[table[p // block_size], p % block_size] = pk[p]
            value_cache[table[p // block_size], p % block_size] = pv[p]

    total = sum(new)
    q, k, v = randn(total, heads, dim), randn(total, kv_heads, dim), randn(total, kv_heads, dim)
    meta = AttentionMetadata.build(new, cached, tables, block_size, torch.device("cpu"))
    scale = dim**-0.5
    out = get_backend("reference").forward(q, k, v, key_cache, value_cache, meta, scale, window)
    assert out.shape == (total, heads, dim)

    start = 0
    for c, n, pk, pv in zip(cached, new, prefix_k, prefix_v, strict=True):
        sl = slice(start, start + n)
        ctx_k = torch.cat([pk, k[sl]])
        ctx_v = torch.cat([pv, v[sl]])
        expected = dense_attention(q[sl], ctx_k, ctx_v, c, scale, window)
        torch.testing.assert_close(out[sl], expected, atol=1e-5, rtol=1e-5)
        start += n
    # The new keys and values landed in the cache at their slots.
    flat_k = key_cache.view(-1, kv_heads, dim)
    flat_v = value_cache.view(-1, kv_heads, dim)
    assert torch.equal(flat_k[meta.slot_mapping], k)
    assert torch.equal(flat_v[meta.slot_mapping], v)


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 1)])
def test_prefill_without_prefix(block_size: int, heads: int, kv_heads: int) -> None:
    run_case([0, 0, 0], [5, 1, 11], heads, kv_heads, block_size, None, seed=block_size + heads)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 3, 8])
def test_mixed_prefill_with_cached_prefix(block_size: int, window: int | None) -> None:
    # A long prompt, a continuation over a cached prefix, a decode-like single token, a new prompt.
    run_case([0, 9, 17, 0], [13, 4, 1, 2], 8, 2, block_size, window, seed=block_size)


@pytest.mark.parametrize("block_size", [1, 2, 16])
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 1), (4, 2), (2, 2)])
def test_decode(block_size: int, window: int | None, heads: int, kv_heads: int) -> None:
    run_case([6, 0, 31, 15, 2], [1, 1, 1, 1, 1], heads, kv_heads, block_size, window, seed=7)


@pytest.mark.parametrize("window", [None, 5])
def test_decode_rows_beside_prompt_chunks(window: int | None) -> None:
    # Chunked prefill: running requests' decode rows mixed with chunks over long cached contexts.
    run_case([20, 0, 5, 40, 3, 0], [1, 13, 1, 1, 6, 1], 4, 2, 4, window, seed=11)


def test_a_mixed_forward_attends_in_two_groups_planned_once() -> None:
    """Decode rows and prompt chunks are attended apart (padded together, each decode row would
    pay for the chunk's queries), and every layer reuses the split."""
    meta = AttentionMetadata.build([1, 6, 1], [7, 2, 30], [[1, 2], [3, 4], list(range(5, 13))],
                                   4, torch.device("cpu"))
    backend = get_backend("reference")
    caches = torch.zeros(13, 4, 1, 4), torch.zeros(13, 4, 1, 4)
    q, kv = torch.randn(8, 2, 4), torch.randn(8, 1, 4)
    first = backend.forward(q, kv, kv, *caches, meta, 0.5)
    groups = meta.plans.reference_groups
    assert groups is not None and len(groups) == 2
    assert [g.tokens.tolist() for g in groups] == [[0, 7], [1, 2, 3, 4, 5, 6]]
    assert [g.meta.max_seqlen_k for g in groups] == [31, 8]
    assert torch.equal(backend.forward(q, kv, kv, *caches, meta, 0.5), first)
    assert meta.plans.reference_groups is groups


def test_plan_is_shared_across_layers() -> None:
    """Layers reuse one forward's index tensors and masks instead of rebuilding them."""
    meta = AttentionMetadata.build([3, 2], [0, 4], [[1, 2], [3, 4]], 4, torch.device("cpu"))
    backend = get_backend("reference")
    caches = torch.zeros(5, 4, 1, 4), torch.zeros(5, 4, 1, 4)
    q, kv = torch.randn(5, 2, 4), torch.randn(5, 1, 4)
    first = backend.forward(q, kv, kv, *caches, meta, 0.5)
    layout, masks = meta.plans.reference_layout, dict(meta.plans.reference_masks)
    second = backend.forward(q, kv, kv, *caches, meta, 0.5)
    assert torch.equal(first, second)
    assert layout is not None and meta.plans.reference_layout is layout
    assert len(masks) == 1 and meta.plans.reference_masks.keys() == masks.keys()
    assert all(meta.plans.reference_masks[kind] is masks[kind] for kind in masks)


def test_unknown_backend_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'flash9'"):
        get_backend("flash9")


def test_metadata_rejects_too_few_blocks() -> None:
    with pytest.raises(ValueError, match="needs 3 blocks of 4, has 2"):
        AttentionMetadata.build([5], [4], [[1, 2]], 4, torch.device("cpu"))
