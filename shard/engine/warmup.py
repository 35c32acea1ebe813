"""Warmup: run the largest prefill the router will send, then size the KV cache.

This module holds the measurements, on plain values; the model runner runs them in order and
alone allocates its KV cache and holds the decode graphs (ModelRunner.size_kv_cache,
ModelRunner.resize_kv_cache, shard/engine/model_runner.py), and the engine runs the warmup batch
through its own Prefill and Decode (Engine.warmup).

The warmup batch exercises every logits processor, top-n tokens and prefill logprobs, so that the
measured peak is the real worst case. On GPU the cache then takes what is left of the device
(under --cuda-memory-fraction) after keeping room for that peak and for the decode CUDA graphs;
on CPU it takes the budget the router or --max-total-tokens imposes, else a bounded share of RAM.

The graphs' memory (their private pool: every bucket's activations, logits and library
workspaces, plus the graphs themselves) is measured, not guessed: they are captured once into the
small warmup cache, the device's free memory is read before and after, and they are let go. Once
the cache is allocated they are captured again over it (a graph holds the cache's addresses),
into the room kept for them.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pytgi_proto import generate_pb2
from pytgi_shard.attention.kv_cache import KVCache
from pytgi_shard.attention.kv_quant import kv_cache_dtype
from pytgi_shard.device.capabilities import DeviceCapabilities
from pytgi_shard.device.distributed import Dist
from pytgi_shard.engine.background_compile import compile_in_background
from pytgi_shard.engine.decode_graphs import (
    DecodeGraphRunner,
    HiddenTap,
    resolve_buckets,
)
from pytgi_shard.engine.graphs_off import graphs_off_reason
from pytgi_shard.errors import InvalidRequest, OutOfMemory
from pytgi_shard.models.model import Model
from pytgi_shard.settings import ShardSettings

log = logging.getLogger(__name__)

# u64::MAX is the router's health-check batch; warmup uses the id below it.
WARMUP_BATCH_ID = 2**64 - 2
# Share of the memory left after the peak that the KV cache may take (allocator fragmentation).
GPU_HEADROOM = 0.95
# CPU default budget: at most this share of available RAM ...
CPU_RAM_SHARE = 0.10
# ... and at most this many full-context sequences.
CPU_MAX_SEQUENCES = 64
_OOM_ADVICE = "decrease --max-batch-prefill-tokens or increase --cuda-memory-fraction"
_GRAPH_ADVICE = "capture fewer or smaller batch sizes with --cuda-graphs (0: none)"


@dataclass(frozen=True, slots=True)
class Limits:
    max_prefill_tokens: int
    max_input_tokens: int
    max_total_tokens: int
    max_batch_size: int
    max_batch_total_tokens: int

    @classmethod
    def from_pb(cls, pb: generate_pb2.WarmupRequest) -> Limits:
        """The request's limits; max_prefill_tokens 0 is for the shard to measure
        (shard/engine/prefill_ladder.py), before any batch is built from it."""
        if pb.max_total_tokens and pb.max_input_tokens >= pb.max_total_tokens:
            raise InvalidRequest(
                f"max_input_tokens ({pb.max_input_tokens}) must be < max_total_tokens "
                f"({pb.max_total_tokens})"
            )
        return cls(
            pb.max_prefill_tokens,
            pb.max_input_tokens,
            pb.max_total_tokens,
            pb.max_batch_size,
            pb.max_batch_total_tokens,
        )


def check_positions(limits: Limits, model: Model) -> None:
    """Refuses a max_total_tokens beyond a learned position table (GPT-2 through the transformers
    fallback): a position past its last row does not exist, and looking it up fails mid-request
    (an index error on the CPU, a device-side assert that poisons the device on CUDA)."""
    limit = model.max_position_embeddings
    if model.learned_positions and limits.max_total_tokens > limit:
        raise InvalidRequest(
            f"max_total_tokens ({limits.max_total_tokens}) exceeds max_position_embeddings "
            f"({limit}) of {model.model_type}, whose learned position table has no row past "
            f"{limit}: set --max-total-tokens to at most {limit}"
        )


def longest_prompt(limits: Limits, max_position_embeddings: int) -> int:
    """The longest prompt the router may send: max_input_tokens, else what the context allows."""
    return limits.max_input_tokens or max(
        (limits.max_total_tokens or max_position_embeddings) - 1, 1
    )


def prompt_lengths(limits: Limits, max_position_embeddings: int) -> list[int]:
    """The warmup prompts: max_prefill_tokens split into requests of at most max_input_tokens."""
    per_request = longest_prompt(limits, max_position_embeddings)
    lengths: list[int] = []
    left = limits.max_prefill_tokens
    while left > 0 and (not limits.max_batch_size or len(lengths) < limits.max_batch_size):
        lengths.append(min(per_request, left))
        left -= lengths[-1]
    return lengths


def warmup_batch(lengths: list[int], vocab_size: int, block_size: int) -> generate_pb2.Batch:
    """Requests with every processor on, generating 2 tokens (a prefill and a decode step)."""
    params = generate_pb2.NextTokenChooserParameters(
        temperature=0.9, top_k=10, top_p=0.9, typical_p=0.9, do_sample=True, seed=0,
        repetition_penalty=1.2, frequency_penalty=0.1, watermark=True,
    )  # fmt: skip
    requests = []
    next_block = 1
    for i, length in enumerate(lengths):
        blocks = math.ceil((length + 1) / block_size)
        requests.append(
            generate_pb2.Request(
                id=i,
                input_ids=[(7 * (i + j)) % vocab_size for j in range(length)],
                parameters=params,
                stopping_parameters=generate_pb2.StoppingCriteriaParameters(
                    max_new_tokens=2, ignore_eos_token=True
                ),
                prefill_logprobs=True,
                top_n_tokens=20,
                blocks=list(range(next_block, next_block + blocks)),
            )
        )
        next_block += blocks
    return generate_pb2.Batch(id=WARMUP_BATCH_ID, requests=requests, size=len(requests))


@dataclass(frozen=True, slots=True)
class CacheSize:
    """What Warmup measured; the engine allocates the cache and captures the graphs from it."""

    # KV blocks for this rank (the same on every rank), block 0 included.
    num_blocks: int
    # Decode batch sizes to capture as CUDA graphs over the cache; () when graphs are off.
    graph_buckets: tuple[int, ...]
    # Device memory kept for those graphs.
    graph_bytes: int


def warmup_limits(
    pb: generate_pb2.WarmupRequest, model: Model, live_batches: int
) -> Limits:
    """The request's limits, or an InvalidRequest before anything is touched."""
    if live_batches:
        # Resizing the KV cache under live batches corrupts them (their blocks may fall outside
        # the new cache): a stray router, e.g. a second instance's, must not do that.
        raise InvalidRequest(
            f"Warmup refused: {live_batches} live batch(es) hold the KV cache; their router "
            "must ClearCache first (is another router connected to this shard?)"
        )
    limits = Limits.from_pb(pb)
    check_positions(limits, model)
    return limits


def no_cache_room() -> OutOfMemory:
    """The error of a device with no room left for a KV cache beyond block 0."""
    return OutOfMemory(f"no memory is left for the KV cache: {_OOM_ADVICE}")


def allocation_failure(num_blocks: int) -> OutOfMemory:
    """The error of a cache of `num_blocks` that Warmup sized but the device could not hold."""
    return OutOfMemory(f"cannot allocate a KV cache of {num_blocks} blocks: {_OOM_ADVICE}")


def warmup_response(
    limits: Limits, model: Model, num_blocks: int, block_size: int, chunking: bool = False
) -> generate_pb2.WarmupResponse:
    """The token limits a cache of `num_blocks` supports, as the router reads them. A shard that
    computes prompts in chunks takes any prompt its context and the cache allow (TGI v3's
    max_total_tokens - 1); one that cannot must fit a prompt in one prefill."""
    capacity = (num_blocks - 1) * block_size
    max_total = limits.max_total_tokens or min(model.max_position_embeddings, capacity)
    max_input = limits.max_input_tokens or (
        max_total - 1 if chunking else min(max_total - 1, limits.max_prefill_tokens)
    )
    kv_sizing = kv_reason(limits, model)
    log.info(
        "KV cache: %d blocks of %d tokens (%d tokens: %s); max_input_tokens %d, "
        "max_total_tokens %d",
        num_blocks, block_size, capacity, kv_sizing, max_input, max_total,
    )  # fmt: skip
    return generate_pb2.WarmupResponse(
        max_supported_total_tokens=capacity,
        max_input_tokens=max_input,
        max_total_tokens=max_total,
        num_blocks=num_blocks,
        block_size=block_size,
        max_prefill_tokens=limits.max_prefill_tokens,
        kv_sizing=kv_sizing,
    )


def kv_reason(limits: Limits, model: Model) -> str:
    """Where the KV cache's size came from (cache_blocks' three ways), for the start-up log."""
    if limits.max_batch_total_tokens:
        return f"the KV budget the router asked for ({limits.max_batch_total_tokens} tokens)"
    if model.device.type == "cuda":
        return (
            "the device memory left under --cuda-memory-fraction after the weights, the largest "
            f"prefill's measured peak and the CUDA graphs, less {1 - GPU_HEADROOM:.0%} headroom"
        )
    return (
        f"on the CPU, {CPU_RAM_SHARE:.0%} of the available RAM, at most {CPU_MAX_SEQUENCES} "
        "full contexts (or the shard's --max-total-tokens)"
    )


def peak_bytes(device: torch.device, run: Callable[[], object]) -> int:
    """The peak device bytes `run` allocates beyond what is allocated when it starts (0 off
    CUDA, where the cache is sized from a budget, not from what is left)."""
    if device.type != "cuda":
        run()
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    run()
    return torch.cuda.max_memory_allocated(device) - base


def prefill_failure(prefill_tokens: int) -> OutOfMemory:
    """The error of a warmup batch of `prefill_tokens` that the device could not run."""
    return OutOfMemory(
        f"not enough memory to handle {prefill_tokens} prefill tokens: {_OOM_ADVICE}"
    )


def graph_buckets(
    settings: ShardSettings, model: Model, caps: DeviceCapabilities, limits: Limits,
    world_size: int = 1,
) -> tuple[int, ...]:
    """The decode batch sizes to capture (on a CPU: to compile, --cpu-graphs); () (and the
    reason, logged) when graphs are off."""
    cpu = caps.kind == "cpu"
    reason = graphs_off_reason(settings, model, caps, world_size)
    if reason is not None:
        log.info("%s off: %s", "compiled decode steps" if cpu else "CUDA graphs", reason)
        return ()
    return resolve_buckets(graph_sizes(settings, caps), limits.max_batch_size)


def graph_sizes(settings: ShardSettings, caps: DeviceCapabilities) -> tuple[int, ...]:
    """The batch sizes asked for: --cpu-graphs on a CPU, --cuda-graphs elsewhere."""
    return settings.cpu_graphs if caps.kind == "cpu" else settings.cuda_graphs


def _graph_runner(
    model: Model, block_size: int, buckets: tuple[int, ...], max_total_tokens: int,
    tap: HiddenTap | None = None,
) -> DecodeGraphRunner:
    max_blocks = math.ceil(max_total_tokens / block_size)
    runner = DecodeGraphRunner(model, buckets, max_blocks, block_size)
    runner.tap = tap
    return runner


def graph_bytes(
    model: Model, kv_cache: KVCache, block_size: int, buckets: tuple[int, ...],
    max_total_tokens: int,
) -> int:
    """Device memory the decode graphs keep, measured by capturing them into `kv_cache` (the
    warmup-sized one): padding rows only touch block 0, which every cache has. A CPU's
    compiled steps keep none: their temporaries come and go per call, as an eager forward's."""
    device = model.device
    if device.type == "cpu":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info(device)[0]
    try:
        runner = _graph_runner(model, block_size, buckets, max_total_tokens)
        runner.capture(kv_cache)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        used = free_before - torch.cuda.mem_get_info(device)[0]
        runner.release()
    except (RuntimeError, MemoryError) as e:
        if not is_out_of_memory(e):
            raise
        raise OutOfMemory(
            f"not enough memory to capture CUDA graphs for batch sizes {list(buckets)}: "
            f"{_GRAPH_ADVICE}"
        ) from e
    finally:
        torch.cuda.empty_cache()
    return max(used, 0)


def capture_graphs(
    model: Model, kv_cache: KVCache, block_size: int, size: CacheSize, max_total_tokens: int,
    tap: HiddenTap | None = None,
) -> DecodeGraphRunner:
    """The graphs over the final `kv_cache`, in the room graph_bytes kept for them; an
    OutOfMemory when that room does not suffice. `tap`: speculator heads' hidden states,
    handed over by each replay (decode_graphs.HiddenTap)."""
    if model.device.type == "cpu":
        return compile_cpu_graphs(model, kv_cache, block_size, size.graph_buckets,
                                  max_total_tokens, tap)
    try:
        runner = _graph_runner(model, block_size, size.graph_buckets, max_total_tokens, tap)
        runner.capture(kv_cache)
    except (RuntimeError, MemoryError) as e:
        if not is_out_of_memory(e):
            raise
        raise OutOfMemory(f"not enough memory left to capture CUDA graphs: {_GRAPH_ADVICE}") from e
    log.info(
        "CUDA graphs: decode batch sizes %s up to %d tokens of context (%.0f MiB kept for them)",
        list(size.graph_buckets), max_total_tokens, size.graph_bytes / 2**20,
    )  # fmt: skip
    return runner


def compile_cpu_graphs(
    model: Model, kv_cache: KVCache, block_size: int, buckets: tuple[int, ...],
    max_total_tokens: int, tap: HiddenTap | None = None,
) -> DecodeGraphRunner:
    """A CPU's decode steps, compiled per bucket after Warmup on a thread
    (--cpu-graphs, shard/engine/background_compile.py): each bucket decodes eagerly until its
    step is ready, and for good when the model's forward cannot be compiled (logged)."""
    runner = _graph_runner(model, block_size, buckets, max_total_tokens, tap)
    compile_in_background(runner, kv_cache)
    log.info("compiling decode steps for batch sizes %s up to %d tokens of context in the "
             "background (until each is ready, its steps run eagerly)", list(buckets),
             max_total_tokens)
    return runner


def is_out_of_memory(e: BaseException) -> bool:
    """CUDA raises torch.OutOfMemoryError; the CPU allocator a RuntimeError or MemoryError."""
    return isinstance(e, torch.OutOfMemoryError | MemoryError) or "memory" in str(e).lower()


def cache_blocks(
    limits: Limits, model: Model, block_size: int, settings: ShardSettings, peak: int,
    draft_per_token: int = 0,
) -> int:
    """KV blocks for this rank, block 0 included, keeping `peak` bytes free for the forward.
    Sized in bytes of the cache's dtype (--kv-cache-dtype: an FP8 cache holds twice the blocks
    of a bfloat16 one). `draft_per_token`: a draft model's cache bytes per token, whose cache
    has a block for each of the target's (shard/engine/draft_model.py): a block id costs both."""
    m = model
    kv_dtype = kv_cache_dtype(settings.kv_cache_dtype, m.dtype)
    per_token = KVCache.bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, kv_dtype)
    per_token += draft_per_token
    block = per_token * block_size
    budget_blocks = (
        math.ceil(limits.max_batch_total_tokens / block_size) + 1
        if limits.max_batch_total_tokens
        else None
    )
    if m.device.type == "cuda":
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(m.device)
        allowed = settings.cuda_memory_fraction * total - torch.cuda.memory_reserved(
            m.device
        )
        usable = (min(free, allowed) - peak) * GPU_HEADROOM
        blocks = max(int(usable // block), 0)
        return min(blocks, budget_blocks) if budget_blocks else blocks
    if budget_blocks:
        return budget_blocks
    tokens = settings.max_total_tokens or _default_cpu_tokens(
        per_token, m.max_position_embeddings
    )
    return math.ceil(tokens / block_size) + 1


def _default_cpu_tokens(per_token: int, max_position_embeddings: int) -> int:
    """A modest share of RAM, and never more than a generous batch of full contexts."""
    by_ram = int(_available_ram() * CPU_RAM_SHARE) // per_token
    return max(min(by_ram, max_position_embeddings * CPU_MAX_SEQUENCES), 1)


def _available_ram() -> int:
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def agree(dist: Dist, device: torch.device, num_blocks: int) -> int:
    """Every rank must use the same number of blocks: the smallest one."""
    if dist.world_size == 1:
        return num_blocks
    mine = torch.tensor([num_blocks], dtype=torch.long, device=device)
    return int(dist.all_gather(mine, dim=0).min())
