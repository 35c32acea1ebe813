"""The admission invariant (issue 11 item 2): on an idle server, every request that passes
validation is admitted, whatever budgets the flags and the shards' Warmup produced.

Budgets that were not whole KV blocks (--max-batch-total-tokens 500 with blocks of 16) used to
leave a request of max_total_tokens waiting at the head of the FIFO forever. Plain Python: the
router's queue, budgets and KV blocks, as Infer installs them, without a shard; with shards
that chunk prompts (a prompt may then exceed the prefill budget) and without.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pytgi_proto import generate_pb2
from pytgi_router.core.capacity import InferStartError, ShardInfo, derive_info, new_cache
from pytgi_router.core.infer_settings import InferSettings
from pytgi_router.core.queue import Queue
from pytgi_router.core.step_plan import Budgets, plan_step
from tests.unit.router.core.test_queue import make_entry


def shard_answers(
    block_size: int, num_blocks: int, max_total: int, chunking: bool = False
) -> tuple[generate_pb2.InfoResponse, generate_pb2.WarmupResponse]:
    info = generate_pb2.InfoResponse(dtype="float32", device_type="cpu", model_type="llama",
                                     block_size=block_size, world_size=1,
                                     support_chunking=chunking, use_prefix_caching=chunking)
    warmup = generate_pb2.WarmupResponse(
        max_supported_total_tokens=(num_blocks - 1) * block_size, num_blocks=num_blocks,
        block_size=block_size, max_input_tokens=max_total - 1, max_total_tokens=max_total,
    )
    return info, warmup


def admitted_on_idle_server(info: ShardInfo, prompt: int, new_tokens: int) -> bool:
    """What the scheduler does first with one request on an idle server."""
    queue = Queue()
    queue.append(make_entry(0, prompt, new_tokens))
    budgets = Budgets.of(InferSettings(max_batch_size=1), info)
    plan = plan_step(new_cache(info), budgets, [], [], queue)
    return len(plan.newcomers) == 1


optional = st.none() | st.integers(1, 3000)


@settings(max_examples=400, deadline=None)
@given(
    block_size=st.sampled_from([1, 4, 16, 32, 64, 256]),
    num_blocks=st.integers(2, 200),
    shard_max_total=st.integers(2, 5000),
    max_batch_total=optional,
    max_total=st.none() | st.integers(2, 3000),
    max_input=optional,
    prefill=st.integers(1, 5000),
    chunking=st.booleans(),
    data=st.data(),
)
def test_every_valid_request_is_admissible_on_an_idle_server(
    block_size: int, num_blocks: int, shard_max_total: int, max_batch_total: int | None,
    max_total: int | None, max_input: int | None, prefill: int, chunking: bool,
    data: st.DataObject,
) -> None:
    flags = InferSettings(max_batch_prefill_tokens=prefill, max_batch_total_tokens=max_batch_total,
                          max_total_tokens=max_total, max_input_tokens=max_input)
    answers = shard_answers(block_size, num_blocks, shard_max_total, chunking)
    try:
        info = derive_info(flags, *answers, 1)
    except InferStartError:
        return  # refused at start-up with a message: nothing is ever served under these flags
    # Validation lets through a prompt of 1..max_input tokens and prompt + max_new_tokens up to
    # max_total_tokens: the extremes and one drawn in between.
    drawn = data.draw(st.integers(1, info.max_input_tokens))
    for prompt in {1, info.max_input_tokens, drawn}:
        assert admitted_on_idle_server(info, prompt, info.max_total_tokens - prompt), (info, prompt)


def test_a_budget_of_partial_blocks_is_rounded_up_to_whole_blocks() -> None:
    """The issue's flags: 500 tokens = 31.25 blocks of 16; the shard's cache holds 33 blocks."""
    flags = InferSettings(max_batch_total_tokens=500, max_total_tokens=500,
                          max_batch_prefill_tokens=500)
    info = derive_info(flags, *shard_answers(16, 33, 500), 1)
    assert info.max_batch_total_tokens == 512 and info.max_total_tokens == 500
    assert admitted_on_idle_server(info, 2, 498)
