"""What the shards can hold, and the limits the router serves with: derived from Info and Warmup
and checked like TGI's router checks them."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from pytgi_proto import contracts, generate_pb2
from pytgi_router.core.infer_settings import InferSettings
from pytgi_router.core.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)


@dataclass
class ShardInfo:
    """What /info and validation need, filled at start()."""

    model_type: str
    dtype: str
    device_type: str
    block_size: int
    world_size: int
    max_input_tokens: int
    max_total_tokens: int
    max_batch_total_tokens: int
    max_batch_prefill_tokens: int
    num_blocks: int
    attention_impl: str
    window_size: int | None
    # Token ids must be below it (the model's embedding rows); 0 when a shard did not say.
    vocab_size: int = 0
    # The shards compute prompts in chunks mixed with the running batch's decode rows (then a
    # prompt may be longer than the prefill budget), and over a cached prefix.
    support_chunking: bool = False
    use_prefix_caching: bool = False
    # TGI's --quantize name of the quantization the shards run ("gptq", "fp8", ...), "" for none.
    quantize: str = ""
    # Up to this many draft tokens per sequence and decode step (the shards' --speculate): each
    # running sequence's blocks hold room for them (step_plan.kv_tokens).
    speculate: int = 0
    # The LoRA adapters the shards serve (--lora-adapters), by name; adapter_index i > 0 is
    # lora_adapters[i - 1].
    lora_adapters: tuple[str, ...] = ()
    # Distinct adapters one step may carry (--max-loras: the shards' device slots; 0: none), and
    # whether /v1/load_lora_adapter and /v1/unload_lora_adapter are served.
    max_loras: int = 0
    lora_runtime_updates: bool = False


class InferStartError(RuntimeError):
    """The settings and the shards' capacity are incompatible; the message says which flag."""


def warmup_request(settings: InferSettings) -> generate_pb2.WarmupRequest:
    return generate_pb2.WarmupRequest(
        # 0: the shards measure it (shard/engine/prefill_budget.py).
        max_prefill_tokens=settings.max_batch_prefill_tokens or 0,
        max_input_tokens=settings.max_input_tokens or 0,
        max_total_tokens=settings.max_total_tokens or 0,
        max_batch_size=settings.max_batch_size or 0,
        max_batch_total_tokens=settings.max_batch_total_tokens or 0,
    )


def pinned_settings(settings: InferSettings, served: ShardInfo) -> InferSettings:
    """`settings` with the request limits already served: a shard group that comes back (after a
    restart) must accept what the validator was built to let through, or not be used at all."""
    return dataclasses.replace(
        settings,
        max_input_tokens=served.max_input_tokens,
        max_total_tokens=served.max_total_tokens,
        max_batch_prefill_tokens=served.max_batch_prefill_tokens,
    )


def derive_info(
    settings: InferSettings,
    info: generate_pb2.InfoResponse,
    warmup: generate_pb2.WarmupResponse,
    world_size: int,
) -> ShardInfo:
    """Final limits from the settings and the shards' answers, checked like TGI's router."""
    block_size = warmup.block_size or info.block_size
    if block_size < 1:
        raise InferStartError("the shards reported no KV block size")
    supported = warmup.max_supported_total_tokens
    num_blocks = warmup.num_blocks or supported // block_size + 1
    if num_blocks < 2:
        raise InferStartError(f"the shards' KV cache holds no usable block ({num_blocks})")
    capacity = (num_blocks - 1) * block_size
    max_batch_total = capacity
    if settings.max_batch_total_tokens is not None:
        max_batch_total = whole_blocks(settings.max_batch_total_tokens, block_size)
        if max_batch_total > capacity:
            logger.warning("--max-batch-total-tokens=%d exceeds the KV cache (%d tokens): using %d",
                           settings.max_batch_total_tokens, capacity, capacity)
            max_batch_total = capacity
        elif max_batch_total != settings.max_batch_total_tokens:
            logger.info("--max-batch-total-tokens=%d rounded up to whole KV blocks of %d: %d",
                        settings.max_batch_total_tokens, block_size, max_batch_total)
    max_total = settings.max_total_tokens or warmup.max_total_tokens
    max_input = settings.max_input_tokens or warmup.max_input_tokens
    prefill = served_prefill(settings, warmup)
    chunking = info.support_chunking
    if prefill > max_batch_total:
        # Harmless but meaningless: no prefill can hold more than the KV cache.
        if settings.max_batch_prefill_tokens is not None:
            logger.warning("--max-batch-prefill-tokens=%d exceeds the KV budget: using %d",
                           prefill, max_batch_total)
        prefill = max_batch_total
    # Defaults must not make a full-length request unschedulable; explicit values are checked.
    if settings.max_total_tokens is None:
        max_total = min(max_total, max_batch_total)
    if settings.max_input_tokens is None:
        # Shards that chunk take a prompt longer than the prefill budget over several steps.
        max_input = min(max_input, max_total - 1) if chunking else min(
            max_input, prefill, max_total - 1)
    check_limits(max_input, max_total, prefill, max_batch_total, block_size, chunking)
    return ShardInfo(
        model_type=info.model_type,
        dtype=info.dtype,
        device_type=info.device_type,
        block_size=block_size,
        world_size=info.world_size or world_size,
        max_input_tokens=max_input,
        max_total_tokens=max_total,
        max_batch_total_tokens=max_batch_total,
        max_batch_prefill_tokens=prefill,
        num_blocks=num_blocks,
        attention_impl=info.attention_impl,
        window_size=info.window_size if info.HasField("window_size") else None,
        vocab_size=info.vocab_size,
        support_chunking=chunking,
        use_prefix_caching=info.use_prefix_caching,
        quantize=info.quantize,
        speculate=info.speculate,
        lora_adapters=tuple(info.lora_adapters),
        max_loras=info.max_loras,
        lora_runtime_updates=info.lora_runtime_updates,
    )


def served_prefill(settings: InferSettings, warmup: generate_pb2.WarmupResponse) -> int:
    """The flag, else what the shards measured at Warmup, else (a shard that answers no
    budget) TGI's default."""
    return (
        settings.max_batch_prefill_tokens
        or warmup.max_prefill_tokens
        or contracts.MAX_BATCH_PREFILL_TOKENS
    )


def whole_blocks(tokens: int, block_size: int) -> int:
    """`tokens` rounded up to whole KV blocks.

    The router reserves KV in whole blocks (a request of 500 tokens holds 32 blocks of 16 = 512),
    so a budget that is not a multiple of the block size could never admit a request of
    `max_total_tokens` on an idle server: it waited at the head of the FIFO forever and jammed
    the queue behind it. Rounding up (rather than refusing the flag) costs nothing: the shards
    already size their cache to whole blocks (ceil(budget / block_size)), so the extra tokens of
    the last block are memory they hold anyway.
    """
    return -(-tokens // block_size) * block_size


def new_cache(info: ShardInfo, prefix_caching: bool = True) -> PrefixCache:
    """The router's KV blocks for `info`: only the blocks of the KV budget (whole blocks), with
    prefix caching when the flag asks for it and the shards can attend over a cached prefix."""
    return PrefixCache(
        info.num_blocks, info.block_size, info.max_batch_total_tokens // info.block_size,
        prefix_caching=prefix_caching and info.use_prefix_caching,
    )


def check_limits(
    max_input: int,
    max_total: int,
    prefill: int,
    max_batch_total: int,
    block_size: int = 1,
    chunking: bool = False,
) -> None:
    """Refuses settings under which a request that passes validation could never be admitted on
    an idle server: its KV, in whole blocks, must fit the KV budget, and (unless the shards
    compute prompts in chunks) its prompt the prefill budget."""
    if prefill < 1:
        raise InferStartError(f"`max_batch_prefill_tokens` must be >= 1, got {prefill}")
    if max_input < 1 or max_input >= max_total:
        raise InferStartError(f"`max_input_tokens` ({max_input}) must be >= 1 and < "
                              f"`max_total_tokens` ({max_total})")
    if whole_blocks(max_total, block_size) > max_batch_total:
        raise InferStartError(f"Not enough memory to handle max_total_tokens={max_total} "
                              f"({whole_blocks(max_total, block_size)} tokens in whole KV blocks "
                              f"of {block_size}): the KV cache holds {max_batch_total} tokens "
                              f"(`max_batch_total_tokens`)")
    if max_input > prefill and not chunking:
        raise InferStartError(f"`max_batch_prefill_tokens` ({prefill}) must be >= "
                              f"`max_input_tokens` ({max_input})")
