"""Zero-config sizing, router side: the prefill budget the shards measured is served unless a flag
sets it (capacity.served_prefill, derive_info), and each served limit's start-up line says where
it came from (core/sizing_report.py)."""

from __future__ import annotations

import pytest

from pytgi_proto import contracts
from pytgi_proto import generate_pb2 as pb
from pytgi_router.core.capacity import derive_info, warmup_request
from pytgi_router.core.infer_settings import InferSettings
from pytgi_router.core.sizing_report import sizing_lines

INFO = pb.InfoResponse(
    dtype="float32", device_type="cpu", attention_impl="reference", block_size=16,
    model_type="llama", world_size=1, support_chunking=True, max_position_embeddings=4096,
)
LADDER = ("prefill throughput measured at 256/512/1024 tokens: 9000/15000/15500 tok/s (ladder "
          "stopped: throughput rose < 10% over the last two doublings); 512 is the smallest "
          "within 10% of the peak (15500 tok/s at 1024)")
KV = "on the CPU, 10% of the available RAM"


def warmup(blocks: int = 1025, prefill: int = 512, sizing: str = LADDER) -> pb.WarmupResponse:
    """A chunking shard's answer: its KV capacity, max_total = min(context, capacity)."""
    capacity = (blocks - 1) * 16
    total = min(4096, capacity)
    return pb.WarmupResponse(
        max_supported_total_tokens=capacity, max_input_tokens=total - 1, max_total_tokens=total,
        num_blocks=blocks, block_size=16, max_prefill_tokens=prefill, prefill_sizing=sizing,
        kv_sizing=KV,
    )


def test_the_router_leaves_the_budget_to_the_shards_unless_a_flag_sets_it() -> None:
    assert warmup_request(InferSettings()).max_prefill_tokens == 0
    assert warmup_request(InferSettings(max_batch_prefill_tokens=300)).max_prefill_tokens == 300


def test_measured_limits_are_served_and_explained() -> None:
    settings = InferSettings()
    answer = warmup()
    served = derive_info(settings, INFO, answer, 1)
    assert (served.max_batch_prefill_tokens, served.max_batch_total_tokens) == (512, 16384)
    assert (served.max_total_tokens, served.max_input_tokens) == (4096, 4095)
    assert sizing_lines(settings, INFO, answer, served) == [
        f"max-batch-prefill-tokens 512: measured by the shards at Warmup: {LADDER}",
        f"max-batch-total-tokens 16384: the shards' KV cache (1024 blocks of 16 tokens): {KV}",
        "max-total-tokens 4096: the model's context (max_position_embeddings)",
        "max-input-tokens 4095: max-total-tokens - 1 (prompts longer than the prefill budget "
        "are computed in chunks)",
    ]


def test_a_small_cache_bounds_the_request_and_the_budget() -> None:
    settings = InferSettings()
    answer = warmup(blocks=33, prefill=1024)
    served = derive_info(settings, INFO, answer, 1)
    lines = sizing_lines(settings, INFO, answer, served)
    assert served.max_batch_prefill_tokens == served.max_total_tokens == 512
    assert lines[0].endswith("; 1024 capped to the KV budget (512)")
    assert lines[2] == "max-total-tokens 512: the KV budget, below the model's context (4096)"


def test_flags_win_and_say_so() -> None:
    settings = InferSettings(max_batch_prefill_tokens=300, max_batch_total_tokens=1000,
                             max_input_tokens=100, max_total_tokens=200)
    answer = warmup(prefill=300, sizing="")
    served = derive_info(settings, INFO, answer, 1)
    assert (served.max_batch_prefill_tokens, served.max_batch_total_tokens,
            served.max_input_tokens, served.max_total_tokens) == (300, 1008, 100, 200)
    assert sizing_lines(settings, INFO, answer, served) == [
        "max-batch-prefill-tokens 300: --max-batch-prefill-tokens",
        "max-batch-total-tokens 1008: --max-batch-total-tokens 1000 rounded up to whole KV blocks",
        "max-total-tokens 200: --max-total-tokens",
        "max-input-tokens 100: --max-input-tokens",
    ]


def test_a_shard_that_measured_nothing_gets_tgis_default() -> None:
    answer = warmup(prefill=0, sizing="")
    served = derive_info(InferSettings(), INFO, answer, 1)
    assert served.max_batch_prefill_tokens == contracts.MAX_BATCH_PREFILL_TOKENS
    assert "TGI's default" in sizing_lines(InferSettings(), INFO, answer, served)[0]


def test_a_shard_that_cannot_chunk_fits_a_prompt_in_one_prefill() -> None:
    info = pb.InfoResponse()
    info.CopyFrom(INFO)
    info.support_chunking = False
    answer = warmup(prefill=2048, sizing="...; raised to 2048: one whole prompt")
    answer.max_input_tokens = 2048
    served = derive_info(InferSettings(), info, answer, 1)
    assert served.max_input_tokens == served.max_batch_prefill_tokens == 2048
    line = sizing_lines(InferSettings(), info, answer, served)[3]
    assert line == ("max-input-tokens 2048: max-batch-prefill-tokens (these shards compute a "
                    "prompt in one prefill)")


@pytest.mark.parametrize("bad", [0, -1])
def test_a_zero_budget_is_refused_not_measured(bad: int) -> None:
    with pytest.raises(ValueError, match="max_batch_prefill_tokens"):
        InferSettings(max_batch_prefill_tokens=bad)
