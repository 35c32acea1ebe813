"""ALiBi in the attention interface (BLOOM, MPT): the reference backend and the Triton kernels
(under TRITON_INTERPRET=1 on CPU) against a dense float64 oracle, over paged batches with cached
prefixes, decode rows and grouped heads; without slopes the scores are untouched."""

from __future__ import annotations

import pytest
import torch

from pytgi_shard.attention import get_backend
from pytgi_shard.layers.alibi import alibi_slopes
from tests.unit.shard.attention.test_triton_attention import DEVICE, Case, fresh_meta, make_case

pytest.importorskip("triton", reason="triton is not installed")

from pytgi_shard.attention.triton_backend import TritonAttention  # noqa: E402


def dense_alibi(case: Case, slopes: torch.Tensor, window: int | None) -> torch.Tensor:
    """Attention with slope_h * (j - i) added to the scaled scores, request by request (after the
    cache writes), in float64."""
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
        qpos = torch.arange(ctx - (q1 - q0), ctx, device=DEVICE).view(-1, 1)
        rel = (pos.view(1, -1) - qpos).double()
        scores = scores + slopes.double().view(-1, 1, 1) * rel
        allowed = pos.view(1, -1) <= qpos
        if window is not None:
            allowed &= qpos - pos.view(1, -1) < window
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs).float()


CASES = [
    # decode rows only (contexts 1, across blocks, long)
    ([0, 16, 33, 5], [1, 1, 1, 1], None),
    # prefill over cached prefixes beside a decode row and a fresh prompt
    ([0, 21, 17, 0], [35, 18, 1, 2], None),
    ([0, 21, 17, 0], [35, 18, 1, 2], 9),
]


@pytest.mark.parametrize(("cached", "new", "window"), CASES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (6, 6)])
def test_reference_and_triton_match_the_oracle(
    cached: list[int], new: list[int], window: int | None, heads: int, kv_heads: int
) -> None:
    case = make_case(cached, new, heads, kv_heads, 4, seed=heads + len(cached))
    # Steep slopes, so that a bias on the wrong head or position changes the output.
    slopes = (alibi_slopes(heads) * 8).to(DEVICE)
    scale = case.q.shape[-1] ** -0.5
    ref_case = make_case(cached, new, heads, kv_heads, 4, seed=heads + len(cached))
    ref = get_backend("reference").forward(
        ref_case.q, ref_case.k, ref_case.v, ref_case.key_cache, ref_case.value_cache,
        fresh_meta(ref_case.meta), scale, window, alibi_slopes=slopes,
    )
    expected = dense_alibi(ref_case, slopes, window)
    torch.testing.assert_close(ref, expected, atol=2e-5, rtol=2e-5)
    # The split count matters to the decode kernel only.
    for splits in (1, 3) if max(new) == 1 else (None,):
        out = TritonAttention(splits).forward(
            case.q, case.k, case.v, case.key_cache, case.value_cache, fresh_meta(case.meta),
            scale, window, alibi_slopes=slopes,
        )
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    plain = get_backend("reference").forward(
        ref_case.q, ref_case.k, ref_case.v, ref_case.key_cache, ref_case.value_cache,
        fresh_meta(ref_case.meta), scale, window,
    )
    assert not torch.allclose(plain, expected, atol=1e-2)


def test_slopes_are_transformers_bloom_and_mpt_ones() -> None:
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    for heads in range(1, 13):
        # BLOOM's bias for key j is slope * j: read the slopes at j = 1.
        bloom = build_alibi_tensor(torch.ones(1, 2), heads, torch.float32)[:, 0, 1]
        torch.testing.assert_close(alibi_slopes(heads), bloom, rtol=1e-6, atol=0)
        for max_bias in (8.0, 16.0):
            # MPT's is slope * (j - (length - 1)): at j = length - 2 it is -slope.
            mpt = build_mpt_alibi_tensor(heads, 2, max_bias)[:, 0, 0]
            torch.testing.assert_close(alibi_slopes(heads, max_bias), -mpt, rtol=1e-6, atol=0)
