"""A forward's flat inputs: every request's chunk of new tokens, after the one-token rows of a
decode (a mixed step), and which logits rows the step reads.

A request's chunk is tokens [cache_len, chunk_end) of its sequence (input_ids then generated_ids),
at their true positions: attention reads the first cache_len tokens from the request's blocks
(seqlens_k = chunk_end), and only the chunk's tokens get slots. A chunk that ends the sequence
samples from its last row; one that stops short (a partial prefill) samples nothing.

Batch.prefill_inputs is the entry point: it hands chunk_inputs its tensors and rows (plain
values and the ChunkRow protocol), so this module needs no import of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.models.media_inputs import StepMedia


@dataclass(slots=True)
class ForwardInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    # The flat tokens that need logits; None: all of them (a decode step).
    lm_head_indices: torch.Tensor | None
    # Row of the logits holding the last token of each request that samples, in order: the
    # decode rows, then the requests whose chunk completes their sequence.
    last_rows: torch.Tensor
    # For prefill logprobs: logits rows and the sequence token each row predicts.
    prompt_rows: torch.Tensor | None = None
    prompt_targets: torch.Tensor | None = None
    # Each flat token's LoRA adapter (0: the base model); None: every token runs the base model.
    adapters: torch.Tensor | None = None
    # A vision-language model's prefill: M-RoPE positions and image rows; None: text only.
    media: StepMedia | None = None


class ChunkRow(Protocol):
    """What a step's inputs read of one request (batch.py's RequestState)."""

    @property
    def cache_len(self) -> int: ...
    @property
    def chunk_end(self) -> int: ...
    @property
    def sequence_length(self) -> int: ...
    @property
    def prefill_logprobs(self) -> bool: ...
    @property
    def complete(self) -> bool: ...
    @property
    def adapter_slot(self) -> int: ...


@dataclass(slots=True)
class _Rows:
    """Host lists of the logits rows a step reads (built once per step, a few per request)."""

    indices: list[int]
    last: list[int]
    prompt: list[int]
    targets: list[torch.Tensor]


def predicted_count(cache_len: int, chunk_end: int, sequence_length: int) -> int:
    """How many sequence tokens a chunk's rows predict: row p predicts token p + 1, and the
    last row of the sequence predicts a generated token, not a sequence one."""
    return min(chunk_end, sequence_length - 1) - cache_len


def chunk_inputs(
    requests: Sequence[ChunkRow],
    all_ids: torch.Tensor,
    slot_table: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    decode: ForwardInputs | None = None,
) -> ForwardInputs:
    """The chunks of every request (a batch's rows, with its token, slot and block tables),
    flat, after `decode`'s rows when given (one token per request: the cached batch's next
    decode step, computed in the same forward)."""
    device = all_ids.device
    starts = [r.cache_len for r in requests]
    ends = [r.chunk_end for r in requests]
    q_lens = [e - s for s, e in zip(starts, ends, strict=True)]
    total = sum(q_lens)
    q_lens_t = torch.tensor(q_lens, dtype=torch.long, device=device)
    cu = torch.nn.functional.pad(torch.cumsum(q_lens_t, 0), (1, 0))
    request_of_token = torch.repeat_interleave(
        torch.arange(len(requests), device=device), q_lens_t, output_size=total
    )
    offsets = torch.tensor(starts, dtype=torch.long, device=device) - cu[:-1]
    positions = torch.arange(total, device=device) + offsets[request_of_token]
    input_ids = all_ids[request_of_token, positions]
    slots = slot_table[request_of_token, positions]
    n_decode = 0 if decode is None else decode.meta.batch_size
    rows = _logits_rows(requests, all_ids, starts, ends, n_decode)
    meta = AttentionMetadata(
        is_prefill=max(q_lens) > 1,
        cu_seqlens_q=cu.to(torch.int32),
        seqlens_k=torch.tensor(ends, dtype=torch.int32, device=device),
        slot_mapping=slots,
        block_tables=block_tables,
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(ends),
        block_size=block_size,
    )
    adapters = token_adapters([r.adapter_slot for r in requests], q_lens_t, total)
    if decode is not None:
        adapters = _joined_adapters(decode, adapters, total)
        input_ids = torch.cat([decode.input_ids, input_ids])
        positions = torch.cat([decode.positions, positions])
        meta = _after_decode(decode.meta, meta)

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    prompt = rows.targets
    return ForwardInputs(
        input_ids,
        positions,
        meta,
        tensor(rows.indices),
        tensor(rows.last),
        tensor(rows.prompt) if prompt else None,
        torch.cat(prompt) if prompt else None,
        adapters,
    )


def token_adapters(per_row: list[int], counts: torch.Tensor, total: int) -> torch.Tensor | None:
    """Each flat token's adapter from its row's (`counts` tokens per row); None when every row
    runs the base model, so that a batch without adapters costs nothing."""
    if not any(per_row):
        return None
    rows = torch.tensor(per_row, dtype=torch.long, device=counts.device)
    return torch.repeat_interleave(rows, counts, output_size=total)


def _joined_adapters(
    decode: ForwardInputs, chunks: torch.Tensor | None, chunk_tokens: int
) -> torch.Tensor | None:
    """The decode rows' adapters then the chunks' (zeros for a side without any)."""
    if decode.adapters is None and chunks is None:
        return None
    device = decode.input_ids.device
    first = decode.adapters if decode.adapters is not None else torch.zeros(
        decode.input_ids.shape[0], dtype=torch.long, device=device)
    second = chunks if chunks is not None else torch.zeros(
        chunk_tokens, dtype=torch.long, device=device)
    return torch.cat([first, second])


def _logits_rows(
    requests: Sequence[ChunkRow], all_ids: torch.Tensor, starts: list[int], ends: list[int],
    n_decode: int,
) -> _Rows:
    """lm_head_indices: each decode row; each completing request's last token; every predicting
    row of the requests that want prefill logprobs."""
    rows = _Rows(list(range(n_decode)), list(range(n_decode)), [], [])
    first_token = n_decode
    for row, (r, start, end) in enumerate(zip(requests, starts, ends, strict=True)):
        if r.prefill_logprobs:
            count = predicted_count(start, end, r.sequence_length)
            first_row = len(rows.indices)
            rows.prompt.extend(range(first_row, first_row + count))
            rows.targets.append(all_ids[row, start + 1 : start + 1 + count])
            rows.indices.extend(range(first_token, first_token + end - start))
        elif r.complete:
            rows.indices.append(first_token + end - start - 1)
        if r.complete:
            rows.last.append(len(rows.indices) - 1)
        first_token += end - start
    return rows


def _after_decode(decode: AttentionMetadata, chunks: AttentionMetadata) -> AttentionMetadata:
    """One metadata for decode rows followed by chunk rows (block tables padded to one width)."""
    width = max(decode.block_tables.shape[1], chunks.block_tables.shape[1])
    tables = [
        torch.nn.functional.pad(t, (0, width - t.shape[1]))
        for t in (decode.block_tables, chunks.block_tables)
    ]
    n_decode = decode.batch_size
    return AttentionMetadata(
        is_prefill=chunks.is_prefill,
        cu_seqlens_q=torch.cat([decode.cu_seqlens_q[:-1], chunks.cu_seqlens_q + n_decode]),
        seqlens_k=torch.cat([decode.seqlens_k, chunks.seqlens_k]),
        slot_mapping=torch.cat([decode.slot_mapping, chunks.slot_mapping]),
        block_tables=torch.cat(tables),
        max_seqlen_q=max(decode.max_seqlen_q, chunks.max_seqlen_q),
        max_seqlen_k=max(decode.max_seqlen_k, chunks.max_seqlen_k),
        block_size=chunks.block_size,
    )
