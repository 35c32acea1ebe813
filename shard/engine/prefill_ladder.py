"""Warmup's prefill ladder: real prefills timed at doubling sizes, for the prefill budget.

When the router leaves --max-batch-prefill-tokens to the shards (WarmupRequest.max_prefill_tokens
0), Warmup runs, before it sizes the KV cache, plain prefills (greedy, one new token, no prompt
logprobs) of 256, 512, 1,024, ... tokens through the Engine's own Prefill, each in a KV cache of
its size, and measures each step's time (its fastest of `repeats` runs, the slowest rank's) and,
on CUDA, its activation peak. The policy on those numbers (when to stop, which size to serve
with, and why) is shard/engine/prefill_budget.py's; this module only measures and bounds.

Every rank runs the same ladder (its batches hold collectives): the ranks agree on each rung's
numbers (the slowest), so they stop at the same rung and choose the same budget.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import torch

from pytgi_proto import generate_pb2
from pytgi_shard.engine.model_runner import ModelRunner, RunBatch
from pytgi_shard.engine.prefill_budget import (
    Bounds,
    LadderPolicy,
    PrefillChoice,
    Rung,
    choose,
    next_rung,
)
from pytgi_shard.engine.warmup import (
    WARMUP_BATCH_ID,
    Limits,
    cache_blocks,
    is_out_of_memory,
    longest_prompt,
    peak_bytes,
    prefill_failure,
)

log = logging.getLogger(__name__)

# Prompt logprobs hold about this many float32 copies of a prompt token's logits at a time.
LOGIT_COPIES = 3


def resolve_prefill(
    runner: ModelRunner, limits: Limits, run_batch: RunBatch, chunking: bool
) -> tuple[Limits, str]:
    """`limits` with the prefill budget the router asked for, else the one measured here, and
    why (empty when the router set it)."""
    if limits.max_prefill_tokens:
        return limits, ""
    choice = measure_prefill(runner, limits, run_batch, chunking, LadderPolicy())
    return dataclasses.replace(limits, max_prefill_tokens=choice.tokens), choice.why


def measure_prefill(
    runner: ModelRunner, limits: Limits, run_batch: RunBatch, chunking: bool,
    policy: LadderPolicy,
) -> PrefillChoice:
    """Climbs the ladder and chooses; the KV cache is block 0 alone again afterwards."""
    runner.release_graphs()
    bounds = ladder_bounds(runner, limits, chunking, policy)
    rungs: list[Rung] = []
    started = time.perf_counter()
    try:
        stopped = _climb(runner, limits, run_batch, bounds, policy, rungs)
    finally:
        runner.resize_kv_cache(1)
    if not rungs:
        raise prefill_failure(policy.first_rung)
    choice = choose(rungs, bounds, policy, stopped)
    log.info("max-batch-prefill-tokens %d (measured in %.2f s): %s",
             choice.tokens, time.perf_counter() - started, choice.why)
    return choice


def _climb(
    runner: ModelRunner, limits: Limits, run_batch: RunBatch, bounds: Bounds,
    policy: LadderPolicy, rungs: list[Rung],
) -> str:
    """Measures rungs into `rungs` until the policy stops; returns why it stopped."""
    while True:
        step = next_rung(rungs, bounds, policy)
        if step.tokens is None:
            return step.why
        rung = measure_rung(runner, limits, step.tokens, run_batch, policy, warm=not rungs)
        if rung is None:
            return f"a prefill of {step.tokens} tokens ran out of memory"
        rungs.append(rung)


def ladder_bounds(
    runner: ModelRunner, limits: Limits, chunking: bool, policy: LadderPolicy
) -> Bounds:
    """The ceiling (the ladder's top, the KV budget, --max-batch-size whole prompts), the
    activation memory allowed (CUDA), and a whole prompt's floor for shards that cannot chunk."""
    model = runner.model
    longest = longest_prompt(limits, model.max_position_embeddings)
    ceilings = [(policy.top_rung, f"the ladder's top ({policy.top_rung})")]
    kv = _kv_tokens(runner, limits)
    if kv is not None:
        ceilings.append((kv, f"the KV budget ({kv} tokens)"))
    if limits.max_batch_size:
        whole = limits.max_batch_size * longest
        ceilings.append((whole, f"--max-batch-size {limits.max_batch_size} prompts of {longest}"))
    ceiling, why = min(ceilings, key=lambda c: c[0])
    activation = _activation_room(runner, policy)
    return Bounds(
        ceiling=max(ceiling, 1), ceiling_why=why, activation_bytes=activation,
        logits_bytes_per_token=model.vocab_size * 4 * LOGIT_COPIES if activation else 0,
        floor=0 if chunking else longest,
        floor_why="" if chunking else "one whole prompt (these shards do not chunk prompts)",
    )


def _kv_tokens(runner: ModelRunner, limits: Limits) -> int | None:
    """The KV tokens a rung may hold: the router's budget; on the CPU the cache's own budget
    (a rung's cache must fit what the final one will); None on CUDA (memory bounds it)."""
    if limits.max_batch_total_tokens:
        return limits.max_batch_total_tokens
    if runner.model.device.type == "cuda":
        return None
    blocks = cache_blocks(limits, runner.model, runner.block_size, runner.settings, 0)
    return (blocks - 1) * runner.block_size


def _activation_room(runner: ModelRunner, policy: LadderPolicy) -> int:
    """On CUDA, the share of the memory beside the weights (under --cuda-memory-fraction) that
    a prefill's activations may take; 0 elsewhere (not measured)."""
    device = runner.model.device
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    allowed = runner.settings.cuda_memory_fraction * total - torch.cuda.memory_reserved(device)
    return int(max(min(free, allowed), 0) * policy.activation_share)


def ladder_lengths(tokens: int, longest: int, max_batch_size: int, prompt_tokens: int) -> list[int]:
    """A rung's prompts: `tokens` in prompts of `prompt_tokens` (at most `longest`), longer when
    --max-batch-size allows fewer prompts."""
    length = min(prompt_tokens, longest)
    if max_batch_size:
        length = min(max(length, math.ceil(tokens / max_batch_size)), longest)
    full, rest = divmod(tokens, length)
    return [length] * full + ([rest] if rest else [])


def ladder_batch(lengths: list[int], vocab_size: int, block_size: int) -> generate_pb2.Batch:
    """Plain requests (greedy, one new token): a prefill as most requests run it."""
    requests = []
    next_block = 1
    for i, length in enumerate(lengths):
        blocks = math.ceil((length + 1) / block_size)
        requests.append(generate_pb2.Request(
            id=i,
            input_ids=[(7 * (i + j) + 3) % vocab_size for j in range(length)],
            parameters=generate_pb2.NextTokenChooserParameters(),
            stopping_parameters=generate_pb2.StoppingCriteriaParameters(
                max_new_tokens=1, ignore_eos_token=True),
            blocks=list(range(next_block, next_block + blocks)),
        ))  # fmt: skip
        next_block += blocks
    return generate_pb2.Batch(id=WARMUP_BATCH_ID, requests=requests, size=len(requests))


def measure_rung(
    runner: ModelRunner, limits: Limits, tokens: int, run_batch: RunBatch, policy: LadderPolicy,
    warm: bool = False,
) -> Rung | None:
    """One rung: its fastest run and its peak, agreed across ranks; None when it ran out of
    memory on any rank (the cache is block 0 alone again then). `warm`: one untimed run first,
    for the ladder's first rung: a process's first prefills pay for thread pools, allocator
    growth and kernel compilation, and every run of that rung measured 2.5x slow without it
    (tiny Llama on the CPU), which made the ladder climb for throughput that was not there."""
    model = runner.model
    longest = longest_prompt(limits, model.max_position_embeddings)
    lengths = ladder_lengths(tokens, longest, limits.max_batch_size, policy.prompt_tokens)
    batch = ladder_batch(lengths, model.vocab_size, runner.block_size)
    times: list[float] = []
    peak = 0
    try:
        runner.resize_kv_cache(1 + sum(len(r.blocks) for r in batch.requests))
        if warm:
            run_batch(batch)
        for _ in range(policy.repeats):
            start = time.perf_counter()
            peak = max(peak, peak_bytes(model.device, lambda: run_batch(batch)))
            times.append(time.perf_counter() - start)
            # Too slow to be chosen (or this host too busy): measured enough. Decided on the
            # ranks' slowest, so that every rank runs the same prefills: a rank that stopped on
            # its own clock left the others waiting in a forward's collective (two-rank
            # launches timed out at Warmup on a loaded CI machine).
            if _slowest(runner, [sum(times)])[0] > policy.max_step_s * policy.repeats:
                break
    except (RuntimeError, MemoryError) as e:
        if not is_out_of_memory(e):
            raise
        _let_go(runner)
        times = [math.inf]  # told to the other ranks, which then stop here too
    seconds, peak_agreed, wall = _slowest(runner, [min(times), float(peak), sum(times)])
    if math.isinf(seconds):
        _let_go(runner)
        return None
    return Rung(sum(lengths), seconds, int(peak_agreed), wall)


def _let_go(runner: ModelRunner) -> None:
    """Back to block 0 alone after a rung that ran out of memory, its cached blocks freed."""
    runner.resize_kv_cache(1)
    if runner.model.device.type == "cuda":
        torch.cuda.empty_cache()


def _slowest(runner: ModelRunner, values: list[float]) -> list[float]:
    """Each value's largest over the ranks (a rung's fastest time, peak, wall time), so that
    every rank decides alike (a rank out of memory says inf, and every rank stops)."""
    dist = runner.dist
    if dist.world_size == 1:
        return values
    mine = torch.tensor([values], dtype=torch.float64, device=runner.model.device)
    return dist.all_gather(mine, dim=0).max(dim=0).values.tolist()
