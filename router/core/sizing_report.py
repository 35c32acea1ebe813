"""Where each served token limit came from, one log line per limit, printed at start-up.

Zero-config sizing (TGI v3's idea) only helps if an operator can see what was chosen and why:
the four limits a deployment is tuned by (the prefill budget, the KV budget, a request's total
and its prompt) come from a flag, from the shards' Warmup (a measured prefill ladder, the KV
cache sized from memory), from the model's context, or from another limit. This module turns
the settings, the shards' answers and the served result into those lines; it decides nothing.
"""

from __future__ import annotations

from pytgi_proto import generate_pb2
from pytgi_router.core.capacity import ShardInfo
from pytgi_router.core.infer_settings import InferSettings


def sizing_lines(
    settings: InferSettings,
    info: generate_pb2.InfoResponse,
    warmup: generate_pb2.WarmupResponse,
    served: ShardInfo,
) -> list[str]:
    """One line per limit: `<flag name> <value>: <where it came from>`."""
    return [
        f"max-batch-prefill-tokens {served.max_batch_prefill_tokens}: "
        + prefill_source(settings, warmup, served),
        f"max-batch-total-tokens {served.max_batch_total_tokens}: "
        + kv_source(settings, warmup, served),
        f"max-total-tokens {served.max_total_tokens}: " + total_source(settings, info, served),
        f"max-input-tokens {served.max_input_tokens}: " + input_source(settings, served),
    ]


def _capped(asked: int, served: ShardInfo) -> str:
    """The clause of a prefill budget lowered to the KV budget (no prefill holds more)."""
    if served.max_batch_prefill_tokens < asked:
        return f"; {asked} capped to the KV budget ({served.max_batch_total_tokens})"
    return ""


def prefill_source(
    settings: InferSettings, warmup: generate_pb2.WarmupResponse, served: ShardInfo
) -> str:
    if settings.max_batch_prefill_tokens is not None:
        return "--max-batch-prefill-tokens" + _capped(settings.max_batch_prefill_tokens, served)
    if warmup.prefill_sizing:
        return ("measured by the shards at Warmup: " + warmup.prefill_sizing
                + _capped(warmup.max_prefill_tokens, served))
    return "TGI's default (the shards measured none)" + _capped(
        warmup.max_prefill_tokens or served.max_batch_prefill_tokens, served)


def kv_source(
    settings: InferSettings, warmup: generate_pb2.WarmupResponse, served: ShardInfo
) -> str:
    cache = (f"the shards' KV cache ({served.num_blocks - 1} blocks of {served.block_size} "
             f"tokens)")
    why = f": {warmup.kv_sizing}" if warmup.kv_sizing else ""
    asked = settings.max_batch_total_tokens
    if asked is None:
        return cache + why
    if served.max_batch_total_tokens < asked:
        return f"--max-batch-total-tokens {asked} capped to {cache}"
    if served.max_batch_total_tokens != asked:
        return f"--max-batch-total-tokens {asked} rounded up to whole KV blocks"
    return "--max-batch-total-tokens"


def total_source(
    settings: InferSettings, info: generate_pb2.InfoResponse, served: ShardInfo
) -> str:
    if settings.max_total_tokens is not None:
        return "--max-total-tokens"
    context = info.max_position_embeddings
    if context and served.max_total_tokens == context:
        return "the model's context (max_position_embeddings)"
    if served.max_total_tokens == served.max_batch_total_tokens:
        return f"the KV budget, below the model's context ({context or 'unknown'})"
    return "the shards' answer at Warmup"


def input_source(settings: InferSettings, served: ShardInfo) -> str:
    if settings.max_input_tokens is not None:
        return "--max-input-tokens"
    if served.max_input_tokens == served.max_total_tokens - 1:
        if served.support_chunking:
            return ("max-total-tokens - 1 (prompts longer than the prefill budget are computed "
                    "in chunks)")
        return "max-total-tokens - 1"
    if served.max_input_tokens == served.max_batch_prefill_tokens:
        return "max-batch-prefill-tokens (these shards compute a prompt in one prefill)"
    return "the shards' answer at Warmup"
