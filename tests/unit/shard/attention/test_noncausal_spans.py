"""Bidirectional spans (AttentionMetadata.spans: PaliGemma's prefix, Gemma 3's images): the
reference backend against dense float64 attention under transformers' mask (causal and
windowed, or within the query's span), and the Triton prefill kernel against the reference
(under TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pytgi_shard.attention import AttentionMetadata, get_backend
from pytgi_shard.attention.metadata import noncausal_spans
from pytgi_shard.attention.triton_backend import TritonAttention
from tests.unit.shard.attention.test_triton_attention import DEVICE, Case, make_case


def with_spans(case: Case, cached: list[int], new: list[int],
               spans: list[list[tuple[int, int]]]) -> AttentionMetadata:
    """The case's metadata, fresh plans, with the requests' spans."""
    meta = dataclasses.replace(case.meta, plans=type(case.meta.plans)())
    return dataclasses.replace(meta, spans=noncausal_spans(new, cached, spans, DEVICE))


def dense(case: Case, spans: list[list[tuple[int, int]]], window: int | None) -> torch.Tensor:
    """float64 attention request by request, after the cache writes, under the mask
    (key <= query and within the window) or (key in the query's span)."""
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
        allowed = pos.view(1, -1) <= qpos
        if window is not None:
            allowed &= qpos - pos.view(1, -1) < window
        for lo, hi in spans[i]:
            inside = (qpos >= lo) & (qpos < hi)
            allowed |= inside & (pos.view(1, -1) >= lo) & (pos.view(1, -1) < hi)
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs).float()


CASES = [
    # One prompt, its prefix [0, 12) bidirectional (PaliGemma), 20 new tokens, blocks of 4.
    ([0], [20], [[(0, 12)]], None),
    # Two images in one prompt and a second request with none (Gemma 3), a window of 5 that
    # a 7-token image outlasts (the span still sees its whole image).
    ([0, 0], [30, 9], [[(3, 10), (15, 19)], []], 5),
    # A chunk after a cached prefix, its image wholly inside the chunk; a long span over
    # several 16-key tiles.
    ([10, 0], [25, 40], [[(12, 20)], [(1, 37)]], None),
    ([10, 0], [25, 40], [[(12, 20)], [(1, 37)]], 6),
    # A span starting in the cache (a prefix-cache hit inside it), under a short window.
    ([10], [15], [[(6, 18)]], 4),
    # Mixed: decode rows (no span) beside a chunk holding a span.
    ([12, 5, 0], [1, 1, 14], [[], [], [(2, 9)]], None),
]


@pytest.mark.parametrize(("cached", "new", "spans", "window"), CASES)
def test_reference_and_triton_attend_within_spans(
    cached: list[int], new: list[int], spans: list[list[tuple[int, int]]], window: int | None
) -> None:
    case = make_case(cached, new, 4, 2, 4, seed=5)
    scale = case.q.shape[-1] ** -0.5
    kc, vc = case.key_cache.clone(), case.value_cache.clone()
    ref = get_backend("reference").forward(
        case.q, case.k, case.v, kc, vc, with_spans(case, cached, new, spans), scale, window)
    tri = TritonAttention().forward(
        case.q, case.k, case.v, case.key_cache, case.value_cache,
        with_spans(case, cached, new, spans), scale, window)
    expected = dense(case, spans, window)
    torch.testing.assert_close(ref, expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(tri, expected, atol=2e-5, rtol=2e-5)
    # The spans change the answer (a causal kernel would not pass).
    causal = dense(case, [[] for _ in spans], window)
    assert not torch.allclose(tri, causal, atol=1e-3)


def test_noncausal_spans_marks_the_tokens_of_each_span() -> None:
    spans = noncausal_spans([6, 1], [2, 9], [[(3, 6)], [(0, 4)]], torch.device("cpu"))
    assert spans is not None
    assert spans.tolist() == [[0, 0], [3, 6], [3, 6], [3, 6], [0, 0], [0, 0], [0, 0]]
    # A decode row past its prompt's span and a chunk without spans: plain causal.
    assert noncausal_spans([1, 4], [9, 0], [[(0, 4)], []], torch.device("cpu")) is None


@pytest.mark.parametrize(("cached", "new"), [(0, 5), (4, 2)])
def test_noncausal_spans_refuses_a_span_ending_past_the_forward(cached: int, new: int) -> None:
    with pytest.raises(ValueError, match=r"span \[2, 7\) is split"):
        noncausal_spans([new], [cached], [[(2, 7)]], torch.device("cpu"))


def test_a_span_may_start_in_the_cache() -> None:
    """A prefix-cache hit inside a span the router keyed whole: the rest of it attends to all."""
    spans = noncausal_spans([4], [4], [[(2, 7)]], torch.device("cpu"))
    assert spans is not None and spans.tolist() == [[2, 7]] * 3 + [[0, 0]]
