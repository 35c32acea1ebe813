"""Batch bookkeeping: the flat layout, validation, filter and concatenate, with no model."""

from __future__ import annotations

import math

import pytest
import torch

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.batch import Batch
from pytgi_shard.engine.request_state import BatchContext
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.sample.chooser import Watermark

BLOCK = 4
CTX = BatchContext(
    device=torch.device("cpu"),
    block_size=BLOCK,
    num_blocks=64,
    vocab_size=100,
    eos_ids=frozenset({2}),
    watermark=Watermark(),
)


def request(
    rid: int,
    input_ids: list[int],
    max_new: int = 4,
    blocks: list[int] | None = None,
    block_size: int = BLOCK,
    **fields: object,
) -> pb.Request:
    if blocks is None:
        start = 1 + 8 * rid
        blocks = list(range(start, start + math.ceil((len(input_ids) + max_new) / block_size)))
    stop = fields.pop("stop", ())
    return pb.Request(
        id=rid,
        input_ids=input_ids,
        stopping_parameters=pb.StoppingCriteriaParameters(
            max_new_tokens=max_new,
            stop_sequences=list(stop),  # type: ignore[call-overload]
            ignore_eos_token=bool(fields.pop("ignore_eos", False)),
        ),
        blocks=blocks,
        **fields,  # type: ignore[arg-type]
    )


def batch_of(*requests: pb.Request, batch_id: int = 1) -> pb.Batch:
    return pb.Batch(id=batch_id, requests=requests, size=len(requests))


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (request(1, []), "input_ids is empty"),
        (request(1, [5], max_new=0), "max_new_tokens must be > 0"),
        (request(1, [5, 100]), "token id 100"),
        (request(1, [5] * 6, max_new=4, blocks=[1]), "needs 7"),
        (request(1, [5], blocks=[64, 1]), "block 64 is outside the KV cache"),
        (
            request(1, [5, 6], max_new=2, blocks=[3], slots=[12, 14]),
            "slots must be the consecutive",
        ),
        (
            request(1, [5], parameters=pb.NextTokenChooserParameters(grammar="x", grammar_type=2)),
            "grammar",
        ),
    ],
)
def test_bad_requests_are_rejected_with_a_reason(bad: pb.Request, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        Batch.from_pb(batch_of(request(0, [5]), bad), CTX)


def test_empty_batches_and_duplicate_ids_are_rejected() -> None:
    with pytest.raises(InvalidRequest, match="no requests"):
        Batch.from_pb(batch_of(), CTX)
    with pytest.raises(InvalidRequest, match="duplicate"):
        Batch.from_pb(batch_of(request(3, [5]), request(3, [6])), CTX)


def test_explicit_slots_that_follow_the_blocks_are_accepted() -> None:
    batch = Batch.from_pb(batch_of(request(1, [5, 6], max_new=2, blocks=[3], slots=[12, 13])), CTX)
    assert batch.prefill_inputs().meta.slot_mapping.tolist() == [12, 13]


def test_prefill_inputs_are_flat_with_slots_from_block_tables() -> None:
    batch = Batch.from_pb(
        batch_of(
            request(0, [5, 6, 7, 8, 9], blocks=[7, 3, 9]), request(1, [10, 11], blocks=[4, 5])
        ),
        CTX,
    )
    inputs = batch.prefill_inputs()
    assert inputs.input_ids.tolist() == [5, 6, 7, 8, 9, 10, 11]
    assert inputs.positions.tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert inputs.meta.slot_mapping.tolist() == [28, 29, 30, 31, 12, 16, 17]
    assert inputs.meta.cu_seqlens_q.tolist() == [0, 5, 7]
    assert inputs.meta.seqlens_k.tolist() == [5, 2]
    assert inputs.meta.block_tables.tolist() == [[7, 3, 9], [4, 5, 0]]
    assert inputs.meta.is_prefill and inputs.meta.max_seqlen_q == 5
    assert inputs.lm_head_indices is not None and inputs.lm_head_indices.tolist() == [4, 6]
    assert inputs.prompt_rows is None


def test_prefill_logprob_requests_get_every_prompt_row() -> None:
    batch = Batch.from_pb(
        batch_of(request(0, [5, 6]), request(1, [7, 8, 9], prefill_logprobs=True), request(2, [4])),
        CTX,
    )
    inputs = batch.prefill_inputs()
    assert inputs.lm_head_indices is not None
    assert inputs.lm_head_indices.tolist() == [1, 2, 3, 4, 5]
    assert inputs.last_rows.tolist() == [0, 3, 4]
    assert inputs.prompt_rows is not None and inputs.prompt_targets is not None
    assert inputs.prompt_rows.tolist() == [1, 2]
    assert inputs.prompt_targets.tolist() == [8, 9]


def test_decode_inputs_follow_appended_tokens() -> None:
    batch = Batch.from_pb(
        batch_of(request(0, [5, 6, 7], blocks=[2, 6]), request(1, [9], blocks=[3])), CTX
    )
    batch.append(torch.tensor([40, 41]))
    inputs = batch.decode_inputs()
    assert inputs.input_ids.tolist() == [40, 41]
    assert inputs.positions.tolist() == [3, 1]
    assert inputs.meta.slot_mapping.tolist() == [11, 13]
    assert inputs.meta.seqlens_k.tolist() == [4, 2]
    assert inputs.meta.max_seqlen_k == 4 and not inputs.meta.is_prefill
    batch.append(torch.tensor([50, 51]))
    inputs = batch.decode_inputs()
    assert inputs.positions.tolist() == [4, 2]
    assert inputs.meta.slot_mapping.tolist() == [24, 14]
    assert batch.all_ids[0, :5].tolist() == [5, 6, 7, 40, 50]


def test_filter_and_concatenate_keep_rows_aligned() -> None:
    a = Batch.from_pb(batch_of(request(0, [5, 6]), request(1, [7], max_new=9), batch_id=1), CTX)
    b = Batch.from_pb(batch_of(request(2, [8, 9, 10]), batch_id=2), CTX)
    a.append(torch.tensor([20, 21]))
    b.append(torch.tensor([22]))
    merged = Batch.concatenate([a, b])
    assert merged.batch_id == 1 and merged.request_ids == [0, 1, 2]
    assert merged.decode_inputs().input_ids.tolist() == [20, 21, 22]
    kept = merged.filter([2, 0])
    assert kept.request_ids == [0, 2]
    assert kept.lengths.tolist() == [3, 4]
    assert kept.decode_inputs().input_ids.tolist() == [20, 22]
    assert merged.block_tables.tolist() == [[1, 2, 0], [9, 10, 11], [17, 18, 0]]
    assert kept.block_tables.tolist() == [[1, 2], [17, 18]]
    assert kept.to_pb().max_tokens == (2 + 2) * BLOCK
    assert merged.filter([0, 1, 2]) is merged
    with pytest.raises(InvalidRequest, match=r"\[7\]"):
        merged.filter([7])


def test_to_pb_describes_the_cached_batch() -> None:
    batch = Batch.from_pb(
        batch_of(request(4, [5, 6], blocks=[1, 2]), request(9, [7], blocks=[3])), CTX
    )
    batch.append(torch.tensor([1, 1]))
    cached = batch.to_pb()
    assert list(cached.request_ids) == [4, 9]
    assert (cached.size, cached.max_tokens, cached.current_tokens) == (2, 3 * BLOCK, 2)
