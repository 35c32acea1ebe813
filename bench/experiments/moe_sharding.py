"""Experts split over 2 gloo ranks two ways, measured: each expert column/row-parallel ("tp") or
whole experts per rank ("ep"), for bench/experiments/moe.py.

Both run the same block code (shard/layers/moe.py) with the same single all-reduce; what differs
is the balance. The time of a step is that of the busiest rank (the all-reduce waits for it), so
rank 0's median wall time per forward is reported, and each rank's compute timed alone (the
slower rank's per input). Beside them, from the routings the inputs sample, on 2 and on 8 ranks:
the expert weights the busiest rank reads per forward, in whole-expert units (tp: 1/world of
every chosen expert; ep: the chosen experts that live on the rank holding most of them), which
is what a memory-bound decode step on a GPU pays for.
"""

from __future__ import annotations

import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

BATCHES = (1, 64)
WORLD = 2


@dataclass(slots=True)
class ShardingRow:
    shape: str
    batch: int
    # Rank 0's wall time per forward on 2 gloo processes (all-reduce included).
    tp_ms: float
    ep_ms: float
    # The busiest rank's compute per forward: each rank's share timed alone, in one process,
    # the slower of the two per input (what the step waits for, free of CPU contention).
    tp_busiest_ms: float
    ep_busiest_ms: float
    one_rank_ms: float
    # Expert weights the busiest rank reads per forward, in whole experts, on 2 and on 8 ranks.
    tp_expert_reads: float
    ep_expert_reads: float
    tp_expert_reads_8: float
    ep_expert_reads_8: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load_block(path: Path, dist: Any, sharding: str) -> Any:
    """Layer 0's MoE block of the checkpoint at `path`, this rank's part of it."""
    from pytgi_shard.layers.moe import SparseMoE
    from pytgi_shard.models import ModelConfig
    from pytgi_shard.models.llama.moe import (
        mixtral_config,
        qwen2_moe_config,
        qwen3_moe_config,
    )
    from pytgi_shard.weights.reader import Weights

    raw = ModelConfig.read(path).raw
    read = {"mixtral": mixtral_config, "qwen2_moe": qwen2_moe_config,
            "qwen3_moe": qwen3_moe_config}[raw["model_type"]]  # fmt: skip
    config = read(raw)
    assert config.moe is not None
    weights = Weights(path, torch.float32, dist)
    try:
        prefix = f"model.layers.0.{config.moe.module}"
        return SparseMoE.load(weights, prefix, config.moe, config.hidden_act, sharding)  # type: ignore[arg-type]
    finally:
        weights.close()


def inputs(batch: int, hidden: int, reps: int) -> torch.Tensor:
    """The same inputs on every rank (the block's input is replicated), fresh per repetition."""
    return torch.randn(reps + 2, batch, hidden, generator=torch.Generator().manual_seed(batch))


def _rank_main(rank: int, port: int, path: Path, reps: int, out: Path) -> None:
    from pytgi_bench.experiments.moe import paired_ms
    from pytgi_shard.device.distributed import init_distributed

    torch.set_num_threads(1)
    dist = init_distributed(rank, WORLD, "127.0.0.1", port, torch.device("cpu"))
    try:
        tp, ep = load_block(path, dist, "tp"), load_block(path, dist, "ep")
        times: dict[str, float] = {}
        for batch in BATCHES:
            x = inputs(batch, tp.gate.shape[1], reps)
            with torch.inference_mode():
                # Alternating, so that both see the same load on a shared machine.
                tp_ms, ep_ms = paired_ms([lambda i: tp(x[i]), lambda i: ep(x[i])], reps)  # noqa: B023
            times[f"tp-{batch}"], times[f"ep-{batch}"] = tp_ms, ep_ms
        if rank == 0:
            torch.save(times, out)
    finally:
        dist.close()


def expert_reads(block: Any, x: torch.Tensor, world: int) -> tuple[float, float]:
    """Mean over the inputs of the busiest rank's expert-weight reads per forward on `world`
    ranks, in whole experts: (tp, ep)."""
    from pytgi_shard.layers.moe_routing import route

    per_rank = block.gate.shape[0] // world
    tp, ep = [], []
    for batch in x:
        chosen = route(batch @ block.gate.T, block.top_k, True, batch.dtype).experts.unique()
        tp.append(chosen.numel() / world)
        ep.append(float(torch.bincount(chosen // per_rank, minlength=world).max()))
    return sum(tp) / len(tp), sum(ep) / len(ep)


def busiest_rank_ms(path: Path, sharding: str, x: torch.Tensor, world: int = WORLD) -> float:
    """Median over the inputs of the slowest rank's forward on that input (no all-reduce), each
    rank's time the best of 3 runs: routing decides the balance, not the machine's other load."""
    from pytgi_shard.device.distributed import Dist, single_process

    cpu = torch.device("cpu")
    ranks = []
    for rank in range(world):
        block = load_block(path, Dist(rank, world, cpu, None), sharding)
        block.dist = single_process(cpu)  # this rank's partial sum, nothing to reduce with
        ranks.append(block)
    per_input = []
    with torch.inference_mode():
        for block in ranks:
            block(x[0])
        for batch in x:
            per_input.append(max(_best_of(lambda: block(batch), 3) for block in ranks))  # noqa: B023
    return statistics.median(per_input) * 1e3


def _best_of(run: Callable[[], object], tries: int) -> float:
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure_sharding(path: Path, name: str, reps: int) -> list[ShardingRow]:
    from pytgi_shard.device.distributed import single_process

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.pt"
        mp.spawn(_rank_main, args=(_free_port(), path, reps, out), nprocs=WORLD, join=True)
        times = torch.load(out)
    whole = load_block(path, single_process(torch.device("cpu")), "tp")
    rows = []
    for batch in BATCHES:
        x = inputs(batch, whole.gate.shape[1], reps)
        one = busiest_rank_ms(path, "tp", x, world=1)
        rows.append(ShardingRow(
            name, batch, times[f"tp-{batch}"], times[f"ep-{batch}"],
            busiest_rank_ms(path, "tp", x), busiest_rank_ms(path, "ep", x), one,
            *expert_reads(whole, x, WORLD), *expert_reads(whole, x, 8),
        ))  # fmt: skip
    return rows
