"""bench/experiments/verify_attention.py's token-row layout is the verification step itself:
attention over a varlen step of 1 + k tokens per row equals attention over the same step as one
decode row per token (what DecodeGraphRunner replays), on the reference backend and on Triton's
(its varlen prefill kernel against its decode kernel; interpreted on the CPU)."""

from __future__ import annotations

import pytest
import torch

from pytgi_bench.experiments.attention_kernels import HEAD_DIM, HEADS, KV_HEADS, Inputs
from pytgi_bench.experiments.verify_attention import as_token_rows
from pytgi_shard.attention import AttentionMetadata, get_backend
from pytgi_shard.attention.backend import BACKENDS

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("backend_name", ["reference", *(["triton"] if "triton" in BACKENDS else [])])
def test_a_varlen_verification_step_and_its_token_rows_attend_alike(backend_name: str) -> None:
    g = torch.Generator().manual_seed(0)
    block, cpu = 4, torch.device("cpu")
    # Rows of 3, 1 and 5 new tokens after 6, 9 and 2 cached; blocks interleaved.
    meta = AttentionMetadata.build([3, 1, 5], [6, 9, 2], [[4, 1, 7], [2, 8, 5], [3, 6]], block,
                                   cpu)
    tokens = 9

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    cache = (9, block, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = randn(*cache), randn(*cache)
    varlen = Inputs(randn(tokens, HEADS, HEAD_DIM), randn(tokens, KV_HEADS, HEAD_DIM),
                    randn(tokens, KV_HEADS, HEAD_DIM), k_cache.clone(), v_cache.clone(), meta)
    varlen = Inputs(*(t.to(DEVICE) for t in (varlen.q, varlen.k, varlen.v, varlen.key_cache,
                                              varlen.value_cache)), _on(meta, DEVICE))
    rows = as_token_rows(varlen)
    rows.key_cache, rows.value_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    assert rows.meta.max_seqlen_q == 1 and rows.meta.batch_size == tokens
    backend = get_backend(backend_name)
    scale = HEAD_DIM**-0.5
    expected = backend.forward(varlen.q, varlen.k, varlen.v, varlen.key_cache,
                               varlen.value_cache, varlen.meta, scale)
    got = backend.forward(rows.q, rows.k, rows.v, rows.key_cache, rows.value_cache, rows.meta,
                          scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _on(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    return AttentionMetadata(
        is_prefill=meta.is_prefill, cu_seqlens_q=meta.cu_seqlens_q.to(device),
        seqlens_k=meta.seqlens_k.to(device), slot_mapping=meta.slot_mapping.to(device),
        block_tables=meta.block_tables.to(device), max_seqlen_q=meta.max_seqlen_q,
        max_seqlen_k=meta.max_seqlen_k, block_size=meta.block_size,
    )
