"""Attention of a verification step (--speculate) on CUDA: the two ways a CUDA graph can hold it.

A verification step feeds each drafting row its last token and k drafts (1 + k query tokens per
row) over the paged cache. The engine replays it through the decode graphs as one decode row per
token (shard/engine/verify_graphs.py: `token_rows`, each token its request's block table and its
own context); the alternative is the Triton varlen (prefill) kernel, whose grid follows the host
value max_seqlen_q, captured per (batch, tokens-per-row) bucket. This times one Llama-3-8B layer's
attention (cache write + attention; 32 query heads, 8 KV heads, head_dim 128, bf16, blocks of 16),
both replayed from a CUDA graph, at batch 1 and 2, k = 2 / 4 / 8, contexts 1k / 4k / 8k, beside a
plain decode step of the same batch for scale, and reports each as ms and KV GB read per second
(counting the row's context once). Token rows read a row's KV once per token; the varlen kernel
once per query head: which costs less is what this measures.

    python -m pytgi_bench.experiments.verify_attention [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch

from pytgi_bench.experiments.attention_kernels import (
    HEAD_DIM,
    KV_HEADS,
    Inputs,
    layer_forward,
    make_inputs,
    time_ms,
)
from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.attention.plans import AttentionPlans
from pytgi_shard.engine.decode_graphs import token_rows


@dataclass(slots=True)
class Row:
    layout: str  # "token-rows", "varlen" or "decode" (one token per row, for scale)
    batch: int
    drafts: int
    context: int
    ms: float
    kv_gb_s: float


def as_token_rows(inputs: Inputs) -> Inputs:
    """The same step as a decode step of one row per token (what DecodeGraphRunner loads)."""
    meta = inputs.meta
    tokens = int(inputs.q.shape[0])
    rows, seqlens = token_rows(meta, tokens)
    decode = AttentionMetadata(
        is_prefill=False,
        cu_seqlens_q=torch.arange(tokens + 1, dtype=torch.int32, device=inputs.q.device),
        seqlens_k=seqlens,
        slot_mapping=meta.slot_mapping,
        block_tables=meta.block_tables.index_select(0, rows),
        max_seqlen_q=1,
        max_seqlen_k=meta.max_seqlen_k,
        block_size=meta.block_size,
    )
    return Inputs(inputs.q, inputs.k, inputs.v, inputs.key_cache, inputs.value_cache, decode)


def verify_rows(batch: int, drafts: int, context: int) -> list[Row]:
    new = 1 + drafts
    varlen = make_inputs(batch, new, context - new)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2
    rows = []
    for layout, inputs in (("varlen", varlen), ("token-rows", as_token_rows(varlen)),
                           ("decode", make_inputs(batch, 1, context - 1))):
        inputs.meta.plans = AttentionPlans()
        forward = layer_forward("triton", inputs)
        try:
            ms = time_ms(forward, graph=True)
        except RuntimeError:  # not capturable: timed as it would run, eagerly
            torch.cuda.synchronize()
            inputs.meta.plans = AttentionPlans()
            ms = time_ms(forward)
            layout += "(eager)"
        rows.append(Row(layout, batch, 0 if layout.startswith("decode") else drafts, context, ms,
                        kv_bytes / ms / 1e6))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("verify_attention times CUDA graphs: it needs a GPU")
    rows = [row for batch in (1, 2) for drafts in (2, 4, 8) for context in (1024, 4096, 8192)
            for row in verify_rows(batch, drafts, context)]
    print(f"{'layout':11} {'batch':>5} {'k':>3} {'ctx':>5} {'ms':>9} {'KV GB/s':>9}")
    for r in rows:
        print(f"{r.layout:11} {r.batch:5d} {r.drafts:3d} {r.context:5d} {r.ms:9.4f} "
              f"{r.kv_gb_s:9.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
