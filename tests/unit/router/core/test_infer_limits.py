"""derive_info: the router's final limits from its settings and the shards' Info/Warmup."""

from __future__ import annotations

import pytest

from pytgi_proto import generate_pb2
from pytgi_router.core.capacity import InferStartError, derive_info
from pytgi_router.core.infer_settings import InferSettings

INFO = generate_pb2.InfoResponse(
    dtype="float32", device_type="cpu", attention_impl="reference", block_size=16,
    model_type="llama", world_size=1,
)


def warmup(
    num_blocks: int = 65, max_input: int = 255, max_total: int = 256
) -> generate_pb2.WarmupResponse:
    return generate_pb2.WarmupResponse(
        max_supported_total_tokens=(num_blocks - 1) * 16, max_input_tokens=max_input,
        max_total_tokens=max_total, num_blocks=num_blocks, block_size=16,
    )


def test_defaults_come_from_warmup() -> None:
    info = derive_info(InferSettings(max_batch_prefill_tokens=512), INFO, warmup(), 1)
    assert (info.max_input_tokens, info.max_total_tokens) == (255, 256)
    assert info.max_batch_total_tokens == 64 * 16 and info.num_blocks == 65
    assert (info.block_size, info.model_type, info.window_size) == (16, "llama", None)


def test_user_budget_above_capacity_is_capped() -> None:
    settings = InferSettings(max_batch_prefill_tokens=512, max_batch_total_tokens=10**6)
    assert derive_info(settings, INFO, warmup(), 1).max_batch_total_tokens == 1024
    settings = InferSettings(max_batch_prefill_tokens=512, max_batch_total_tokens=600)
    # Rounded up to whole blocks of 16 (the router reserves KV in whole blocks).
    assert derive_info(settings, INFO, warmup(), 1).max_batch_total_tokens == 608


def test_default_input_limit_fits_the_prefill_budget() -> None:
    info = derive_info(InferSettings(max_batch_prefill_tokens=100), INFO, warmup(), 1)
    assert info.max_input_tokens == 100


def test_prefill_budget_is_capped_by_the_kv_cache() -> None:
    info = derive_info(InferSettings(max_batch_prefill_tokens=4096), INFO, warmup(9), 1)
    assert info.max_batch_prefill_tokens == info.max_batch_total_tokens == 128
    assert info.max_total_tokens == 128 and info.max_input_tokens == 127


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (InferSettings(max_input_tokens=300, max_total_tokens=300), "must be >= 1 and <"),
        (InferSettings(max_total_tokens=5000), "Not enough memory to handle max_total_tokens=5000"),
        (InferSettings(max_batch_prefill_tokens=100, max_input_tokens=200), "must be >="),
    ],
)
def test_incompatible_settings_fail_with_a_clear_message(
    settings: InferSettings, message: str
) -> None:
    with pytest.raises(InferStartError, match=message):
        derive_info(settings, INFO, warmup(), 1)


def test_no_usable_block_is_an_error() -> None:
    with pytest.raises(InferStartError):
        derive_info(InferSettings(), INFO, warmup(num_blocks=1), 1)


@pytest.mark.parametrize(
    "bad",
    [
        {"max_concurrent_requests": 0}, {"max_batch_size": 0}, {"waiting_served_ratio": -0.1},
        {"max_batch_total_tokens": 0}, {"max_queue_size": 0}, {"max_batch_prefill_tokens": 0},
        # A queued request holds a permit: a queue bound at or above the permits never triggers.
        {"max_queue_size": 128}, {"max_queue_size": 4, "max_concurrent_requests": 4},
    ],
)
def test_settings_out_of_range_are_refused(bad: dict[str, float]) -> None:
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        InferSettings(**bad)  # type: ignore[arg-type]


def test_shards_that_chunk_take_prompts_longer_than_the_prefill_budget() -> None:
    chunking = generate_pb2.InfoResponse()
    chunking.CopyFrom(INFO)
    chunking.support_chunking = True
    chunking.use_prefix_caching = True
    info = derive_info(InferSettings(max_batch_prefill_tokens=100), chunking, warmup(), 1)
    assert info.max_input_tokens == 255 and info.max_batch_prefill_tokens == 100
    assert info.support_chunking and info.use_prefix_caching
    explicit = InferSettings(max_batch_prefill_tokens=100, max_input_tokens=200)
    assert derive_info(explicit, chunking, warmup(), 1).max_input_tokens == 200
    # The KV budget still bounds a whole request.
    with pytest.raises(InferStartError, match="Not enough memory"):
        derive_info(InferSettings(max_total_tokens=5000), chunking, warmup(), 1)
