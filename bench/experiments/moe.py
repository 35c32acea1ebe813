"""Mixture-of-experts on the CPU: pytgi's grouped experts against transformers' per-expert loop,
and the two ways of sharding experts over 2 gloo ranks.

    nice -n 10 python -m pytgi_bench.experiments.moe --out bench/results/cpu/moe.json

Two random checkpoints in the proportions of released models, scaled down for a CPU: a
Mixtral-like one (8 experts, top-2, intermediate 3.5x hidden) and a Qwen3-MoE-like one (64 small
experts, top-8, renormalised). For each, at batch 1 and 64:

- block: one MoE block's forward (layer 0), pytgi's (tokens sorted by expert, one matmul per
  expert, shared weights stacked) against transformers 4.57's own block (one_hot / where per
  expert hit) on the same weights and inputs; a fresh input every repetition, so that batch 1
  routes differently each time;
- decode: a whole decode step of the model after a 32-token prompt per request, pytgi's forward
  over the paged cache against transformers' forward with its KV cache;
- sharding (moe_sharding.py): the block on 2 gloo ranks split per expert column/row-parallel
  ("tp") and expert-parallel ("ep"), plus the expert-weight reads of the busiest rank that the
  sampled routings imply (what bounds a memory-bound GPU decode).

Every timing is the median over repetitions of the best of 3 calls, one torch thread per
process; the runs compared alternate within each repetition, so that other work on a shared
machine slows them alike (the JSON records the load average).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pytgi_bench.experiments.moe_sharding import ShardingRow, measure_sharding

PROMPT = 32
# (model_type, config keys): the released models' ratios at CPU size.
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral-like": ("mixtral", {
        "hidden_size": 512, "intermediate_size": 1792, "num_local_experts": 8,
        "num_experts_per_tok": 2,
    }),
    "qwen3-moe-like": ("qwen3_moe", {
        "hidden_size": 512, "moe_intermediate_size": 192, "intermediate_size": 1536,
        "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": True, "head_dim": 64,
    }),
}
COMMON = {
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
    "vocab_size": 4096, "max_position_embeddings": 1024,
}


@dataclass(slots=True)
class Row:
    shape: str
    what: str  # "block" or "decode"
    batch: int
    pytgi_ms: float
    transformers_ms: float
    # transformers' block called once per token (block rows only).
    per_token_ms: float | None = None

    @property
    def speedup(self) -> float:
        return self.transformers_ms / self.pytgi_ms


def build_checkpoint(root: Path, name: str) -> Path:
    """A random checkpoint of SHAPES[name] in Hugging Face layout (weights std 0.02, as
    transformers initialises them: the router's choices spread over all experts)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, keys = SHAPES[name]
    path = root / name
    if not (path / "config.json").is_file():
        config = AutoConfig.for_model(model_type, **COMMON, **keys, dtype="float32")
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path, safe_serialization=True)
    return path


def paired_ms(runs: list[Callable[[int], object]], reps: int, tries: int = 3) -> list[float]:
    """For each run, the median over i in range(reps) of the best of `tries` calls of run(i):
    the runs alternate within each repetition and the best of a few calls drops the moments
    another process had the core (a shared 2-core machine). run(i) must be repeatable; two
    untimed calls of each come first."""
    for run in runs:
        run(0)
        run(1)
    times: list[list[float]] = [[] for _ in runs]
    for i in range(reps):
        for run, spent in zip(runs, times, strict=True):
            best = float("inf")
            for _ in range(tries):
                start = time.perf_counter()
                run(i)
                best = min(best, time.perf_counter() - start)
            spent.append(best)
    return [statistics.median(spent) * 1e3 for spent in times]


def block_rows(name: str, pytgi: Any, hf: Any, reps: int) -> list[Row]:
    from pytgi_shard.layers.moe import SparseMoE

    ours = next(m for m in pytgi.modules() if isinstance(m, SparseMoE))
    layer = hf.model.layers[0]
    theirs = getattr(layer, "block_sparse_moe", None) or layer.mlp
    hidden = hf.config.hidden_size
    rows = []
    for batch in (1, 64):
        x = torch.randn(reps + 2, batch, hidden, generator=torch.Generator().manual_seed(1))

        def per_token(i: int) -> None:
            for token in x[i]:  # noqa: B023
                theirs(token[None, None])

        with torch.inference_mode():
            mine, batched, alone = paired_ms([
                lambda i: ours(x[i]), lambda i: theirs(x[i][None]), per_token  # noqa: B023
            ], reps)  # fmt: skip
        rows.append(Row(name, "block", batch, mine, batched, alone))
    return rows


def decode_rows(name: str, pytgi: Any, hf: Any, steps: int) -> list[Row]:
    rows = []
    for batch in (1, 64):
        with torch.inference_mode():
            mine, theirs = paired_ms(
                [_pytgi_decoder(pytgi, batch, steps), _hf_decoder(hf, batch, steps)], steps
            )
        rows.append(Row(name, "decode", batch, mine, theirs))
    return rows


def _pytgi_decoder(model: Any, batch: int, steps: int) -> Callable[[int], object]:
    """run(i): the decode step of `batch` requests at position PROMPT + i, after their prefill
    (repeatable: the step writes the same cache slots again)."""
    from pytgi_shard.attention import AttentionMetadata
    from pytgi_shard.attention.kv_cache import KVCache

    block = 16
    per_request = -(-(PROMPT + steps + 1) // block)
    tables = [list(range(1 + r * per_request, 1 + (r + 1) * per_request)) for r in range(batch)]
    cache = KVCache.allocate(model.num_layers, 1 + batch * per_request, block, model.num_kv_heads,
                             model.head_dim, model.dtype, model.device)  # fmt: skip
    ids = torch.randint(3, model.vocab_size, (batch, PROMPT + steps + 1))

    def step(start: int, count: int) -> None:
        meta = AttentionMetadata.build([count] * batch, [start] * batch, tables, block, model.device)
        tokens = ids[:, start : start + count].reshape(-1)
        positions = torch.arange(start, start + count).repeat(batch)
        model.forward(tokens, positions, cache, meta, meta.cu_seqlens_q[1:].long() - 1)

    step(0, PROMPT + steps)  # every position's keys and values are in the cache
    return lambda i: step(PROMPT + i, 1)


def _hf_decoder(model: Any, batch: int, steps: int) -> Callable[[int], object]:
    """run(i): transformers' decode step of `batch` requests at position PROMPT + i with its KV
    cache (cropped back to PROMPT + i first, so the step is repeatable)."""
    from transformers import DynamicCache

    ids = torch.randint(3, model.config.vocab_size, (batch, PROMPT + steps + 1))
    cache = DynamicCache()
    model(ids[:, : PROMPT + steps], past_key_values=cache, use_cache=True)

    def step(i: int) -> None:
        at = PROMPT + i
        cache.crop(at)
        model(ids[:, at : at + 1], past_key_values=cache, use_cache=True)

    return step


def measure(name: str, root: Path, reps: int, steps: int) -> list[Row]:
    from transformers import AutoModelForCausalLM

    from pytgi_shard.device.distributed import single_process
    from pytgi_shard.models import ModelConfig, get_model

    path = build_checkpoint(root, name)
    pytgi = get_model(ModelConfig.read(path), dtype=torch.float32,
                      dist=single_process(torch.device("cpu")))  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return block_rows(name, pytgi, hf, reps) + decode_rows(name, pytgi, hf, steps)


def print_tables(command: str, rows: list[Row], sharding: list[ShardingRow]) -> None:
    print(f"# {command}")
    print(f"# CPU, float32, 1 torch thread per process, {torch.__version__}")
    print("| model | what | batch | pytgi ms | transformers ms | speedup | "
          "transformers per token ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        alone = "" if r.per_token_ms is None else f"{r.per_token_ms:.3f}"
        print(f"| {r.shape} | {r.what} | {r.batch} | {r.pytgi_ms:.3f} | "
              f"{r.transformers_ms:.3f} | {r.speedup:.2f}x | {alone} |")  # fmt: skip
    print()
    print("| model | batch | tp: 2 gloo ranks ms | ep: 2 gloo ranks ms | tp: busiest rank ms | "
          "ep: busiest rank ms | 1 rank ms | expert reads, 2 ranks: tp | ep | 8 ranks: tp | ep |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for s in sharding:
        print(f"| {s.shape} | {s.batch} | {s.tp_ms:.3f} | {s.ep_ms:.3f} | {s.tp_busiest_ms:.3f} | "
              f"{s.ep_busiest_ms:.3f} | {s.one_rank_ms:.3f} | {s.tp_expert_reads:.2f} | "
              f"{s.ep_expert_reads:.2f} | {s.tp_expert_reads_8:.2f} | "
              f"{s.ep_expert_reads_8:.2f} |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pytgi_bench.experiments.moe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=None, help="where the checkpoints are built "
                   "(kept for the next run); default: a temporary directory")
    p.add_argument("--reps", type=int, default=20, help="repetitions of each block timing")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps")
    p.add_argument("--out", type=Path, default=None, help="results JSON")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.root or Path(tmp)
        rows = [row for name in SHAPES for row in measure(name, root, args.reps, args.steps)]
        sharding = [
            row for name in SHAPES
            for row in measure_sharding(build_checkpoint(root, name), name, args.reps)
        ]  # fmt: skip
    command = "python -m pytgi_bench.experiments.moe " + shlex.join(argv if argv is not None else sys.argv[1:])
    print_tables(command, rows, sharding)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "command": command, "torch": torch.__version__, "threads_per_process": 1,
            "cpus": os.cpu_count(), "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "rows": [{**asdict(r), "speedup": r.speedup} for r in rows],
            "sharding": [asdict(s) for s in sharding],
        }, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
