"""The Triton attention kernels against the reference backend on random paged batches.

On CPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when
no GPU is present); with a GPU the same tests run the compiled kernels on CUDA. Every cache slot
starts as random data, so a kernel that reads a wrong block or position cannot pass by luck.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from pytgi_shard.attention import AttentionMetadata, get_backend
from tests.unit.shard.triton_device import kernel_dtypes, triton_device

DEVICE, INTERPRETED = triton_device()

from pytgi_shard.attention.triton_backend import TritonAttention  # noqa: E402
from pytgi_shard.attention.triton_cache import write_kv_cache  # noqa: E402
from pytgi_shard.attention.triton_decode import decode_splits  # noqa: E402

ATTENTION_DTYPES = kernel_dtypes(INTERPRETED)
TOLERANCE = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}


@dataclass
class Case:
    """A paged batch: q/k/v of the new tokens, caches holding the cached prefixes, metadata."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    meta: AttentionMetadata


def make_case(
    cached: list[int], new: list[int], heads: int, kv_heads: int, block_size: int,
    dtype: torch.dtype = torch.float32, head_dim: int = 16, seed: int = 0,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    needed = [-(-(c + n) // block_size) for c, n in zip(cached, new, strict=True)]
    num_blocks = sum(needed) + 2
    # Block 0 is the reserved scratch block: never in a table.
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in needed]
    total = sum(new)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    return Case(
        q=randn(total, heads, head_dim),
        k=randn(total, kv_heads, head_dim),
        v=randn(total, kv_heads, head_dim),
        # Random everywhere: cached prefixes and garbage in the slots nobody may read.
        key_cache=randn(num_blocks, block_size, kv_heads, head_dim),
        value_cache=randn(num_blocks, block_size, kv_heads, head_dim),
        meta=AttentionMetadata.build(new, cached, tables, block_size, DEVICE),
    )


def fresh_meta(meta: AttentionMetadata) -> AttentionMetadata:
    """The same batch with empty plans (one metadata per forward, as the engine builds them)."""
    return AttentionMetadata(
        meta.is_prefill, meta.cu_seqlens_q, meta.seqlens_k, meta.slot_mapping, meta.block_tables,
        meta.max_seqlen_q, meta.max_seqlen_k, meta.block_size,
    )


def reference(
    case: Case, window: int | None, softcap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference backend in fp32 on copies: (output, key cache, value cache)."""
    kc, vc = case.key_cache.float().clone(), case.value_cache.float().clone()
    out = get_backend("reference").forward(
        case.q.float(), case.k.float(), case.v.float(), kc, vc, fresh_meta(case.meta),
        case.q.shape[-1] ** -0.5, window, softcap=softcap,
    )
    return out, kc, vc


def run_triton(
    case: Case, window: int | None, num_splits: int | None = None, softcap: float | None = None,
    meta: AttentionMetadata | None = None,
) -> torch.Tensor:
    return TritonAttention(num_splits).forward(
        case.q, case.k, case.v, case.key_cache, case.value_cache, meta or fresh_meta(case.meta),
        case.q.shape[-1] ** -0.5, window, softcap=softcap,
    )


def check(case: Case, window: int | None, num_splits: int | None = None) -> torch.Tensor:
    expected, kc, vc = reference(case, window)
    out = run_triton(case, window, num_splits)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    tol = TOLERANCE[case.q.dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    # The cache writes equal the reference's, bit for bit (a copy, in the cache's dtype).
    assert torch.equal(case.key_cache, kc.to(case.key_cache.dtype))
    assert torch.equal(case.value_cache, vc.to(case.value_cache.dtype))
    return out


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 7])
def test_decode(heads: int, kv_heads: int, num_splits: int, window: int | None) -> None:
    # Contexts of 1, odd, on a block boundary, and over several tiles and blocks.
    case = make_case([0, 16, 32, 48, 4], [1] * 5, heads, kv_heads, 4, seed=heads + num_splits)
    check(case, window, num_splits)


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
def test_decode_dtypes_and_many_splits(dtype: torch.dtype) -> None:
    # More splits than tiles: the empty splits must drop out of the merge.
    case = make_case([70, 2, 33], [1] * 3, 8, 2, 16, dtype=dtype, seed=3)
    check(case, None, num_splits=8)


def test_decode_ignores_the_host_max_seqlen_k() -> None:
    """The decode path reads lengths on the device only, as a captured CUDA graph replays it."""
    case = make_case([40, 9], [1, 1], 4, 2, 8, seed=5)
    expected, _, _ = reference(case, None)
    meta = fresh_meta(case.meta)
    meta.max_seqlen_k = 1
    out = run_triton(case, None, num_splits=4, meta=meta)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_decode_padding_rows_write_nothing_and_stay_finite() -> None:
    """A batch padded to a CUDA-graph bucket: rows with no slot (-1) and no context (0)."""
    case = make_case([12, 30], [1, 1], 4, 2, 4, seed=23)
    expected, kc, vc = reference(case, None)
    m = case.meta
    pad = 2
    meta = AttentionMetadata(
        False, torch.arange(m.batch_size + pad + 1, dtype=torch.int32, device=DEVICE),
        torch.cat([m.seqlens_k, m.seqlens_k.new_zeros(pad)]),
        torch.cat([m.slot_mapping, m.slot_mapping.new_full((pad,), -1)]),
        torch.cat([m.block_tables, m.block_tables.new_zeros(pad, m.block_tables.shape[1])]),
        1, m.max_seqlen_k, m.block_size,
    )
    q, k, v = (torch.cat([t, torch.randn_like(t[:pad])]) for t in (case.q, case.k, case.v))
    padded = Case(q, k, v, case.key_cache, case.value_cache, meta)
    out = run_triton(padded, None, num_splits=2, meta=meta)
    torch.testing.assert_close(out[:-pad], expected, atol=2e-5, rtol=2e-5)
    assert torch.equal(out[-pad:], torch.zeros_like(out[-pad:]))
    assert torch.equal(case.key_cache, kc) and torch.equal(case.value_cache, vc)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [3, 16])
def test_prefill_without_prefix(heads: int, kv_heads: int, block_size: int) -> None:
    check(make_case([0, 0, 0], [5, 1, 37], heads, kv_heads, block_size, seed=heads), None)


@pytest.mark.parametrize("window", [None, 5, 20])
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
def test_prefill_over_cached_prefixes(window: int | None, dtype: torch.dtype) -> None:
    # A long prompt, a chunk after a cached prefix, a decode token, a short new prompt.
    case = make_case([0, 21, 17, 0], [35, 18, 1, 2], 8, 2, 4, dtype=dtype, seed=11)
    check(case, window)


@pytest.mark.parametrize("head_dim", [8, 80, 256])
def test_head_dims_other_than_powers_of_two_and_large(head_dim: int) -> None:
    dtype = torch.float32 if INTERPRETED else torch.bfloat16
    check(make_case([0, 20], [19, 3], 4, 2, 16, dtype=dtype, head_dim=head_dim), 9)
    check(make_case([19, 2], [1, 1], 4, 2, 16, dtype=dtype, head_dim=head_dim), None, 2)


def test_mixed_batch_flagged_as_decode_takes_the_varlen_path() -> None:
    """is_prefill may be False while a request has several tokens; max_seqlen_q decides."""
    case = make_case([6, 12, 0], [1, 3, 1], 4, 2, 4, seed=13)
    case.meta.is_prefill = False
    check(case, None)


def softcapped(case: Case, softcap: float, window: int | None) -> torch.Tensor:
    """Dense float64 attention with tanh soft-capping, request by request, after the writes."""
    meta = case.meta
    d = case.q.shape[-1]
    group = case.q.shape[1] // case.k.shape[1]
    keys = case.key_cache.double().flatten(0, 1)
    values = case.value_cache.double().flatten(0, 1)
    outs = []
    for i in range(meta.batch_size):
        q0, q1 = int(meta.cu_seqlens_q[i]), int(meta.cu_seqlens_q[i + 1])
        ctx = int(meta.seqlens_k[i])
        pos = torch.arange(ctx, device=DEVICE)
        slots = meta.block_tables[i].long()[pos // meta.block_size] * meta.block_size
        slots = slots + pos % meta.block_size
        k = keys[slots].repeat_interleave(group, 1)
        v = values[slots].repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", case.q[q0:q1].double(), k) * d**-0.5
        scores = softcap * torch.tanh(scores / softcap)
        qpos = torch.arange(ctx - (q1 - q0), ctx, device=DEVICE).view(-1, 1)
        allowed = pos.view(1, -1) <= qpos
        if window is not None:
            allowed &= qpos - pos.view(1, -1) < window
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs).float()


@pytest.mark.parametrize(
    ("cached", "new", "window"),
    [([30, 3, 0], [1, 1, 1], None), ([30, 3, 0], [1, 1, 1], 6), ([9, 0], [7, 20], 8),
     ([12, 5, 0], [1, 6, 1], 5)],  # mixed: the reference attends in two groups
)
def test_softcap(cached: list[int], new: list[int], window: int | None) -> None:
    case = make_case(cached, new, 4, 2, 4, seed=17)
    # Large scores so the cap bites: tanh saturates where plain softmax would not.
    case.q *= 4
    capped_reference = reference(case, window, softcap=2.0)[0]
    out = run_triton(case, window, num_splits=2, softcap=2.0)
    expected = softcapped(case, 2.0, window)  # after the writes
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(capped_reference, expected, atol=2e-5, rtol=2e-5)
    uncapped = reference(case, window)[0]
    assert not torch.allclose(out, uncapped, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cache_write_from_strided_views_skips_negative_slots(dtype: torch.dtype) -> None:
    tokens, kv_heads, dim, block_size = 7, 2, 12, 4
    # k and v as the model has them: column slices of one fused projection (not contiguous).
    fused = torch.randn(tokens, 3 * kv_heads * dim).to(dtype).to(DEVICE)
    k = fused[:, kv_heads * dim: 2 * kv_heads * dim].view(tokens, kv_heads, dim)
    v = fused[:, 2 * kv_heads * dim:].view(tokens, kv_heads, dim)
    key_cache = torch.randn(5, block_size, kv_heads, dim).to(dtype).to(DEVICE)
    value_cache = torch.randn_like(key_cache)
    slots = torch.tensor([5, 6, -1, 19, 0, -1, 12], device=DEVICE)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    keep = slots >= 0
    expected_k.view(-1, kv_heads, dim)[slots[keep]] = k[keep]
    expected_v.view(-1, kv_heads, dim)[slots[keep]] = v[keep]
    write_kv_cache(k, v, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


def test_split_rule_depends_on_batch_and_heads_only() -> None:
    assert decode_splits(1, 8, 132) == 16
    assert decode_splits(16, 8, 132) == 4
    assert decode_splits(256, 8, 132) == 1
    assert decode_splits(1, 1, 4, max_splits=4) == 4
    assert isinstance(get_backend("triton"), TritonAttention)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_decode_replays_in_a_cuda_graph() -> None:
    """Captured once, replayed after the lengths and tables change on the device."""
    case = make_case([40, 9, 100], [1] * 3, 8, 2, 16, dtype=torch.float16, seed=19)
    backend = TritonAttention()
    q, k, v = case.q.clone(), case.k.clone(), case.v.clone()
    meta = fresh_meta(case.meta)
    backend.forward(q, k, v, case.key_cache, case.value_cache, meta, 0.25)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, case.key_cache, case.value_cache, meta, 0.25)
    # A later step: one more token each, in the same blocks (same seed, same block counts).
    later = make_case([41, 10, 101], [1] * 3, 8, 2, 16, dtype=torch.float16, seed=19)
    assert torch.equal(later.meta.block_tables, meta.block_tables)
    before = Case(later.q, later.k, later.v, case.key_cache.clone(), case.value_cache.clone(),
                  later.meta)
    for dst, src in ((q, later.q), (k, later.k), (v, later.v),
                     (meta.seqlens_k, later.meta.seqlens_k),
                     (meta.slot_mapping, later.meta.slot_mapping)):
        dst.copy_(src)
    graph.replay()
    expected, kc, vc = reference(before, None)
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)
    assert torch.equal(case.key_cache, kc.half())
