"""LoRA on two tensor-parallel ranks (gloo, one process each): A and B sliced as each rank's
slice of the layer they adapt (column: B's rows; row: A's columns, the update joining the
partial sums before the all-reduce). A batch mixing two adapters and the base model, and a
newcomer beside its decode rows, give on both ranks the tokens and logprobs of one rank."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import ShardSettings
from tests.lora_adapters import write_adapter
from tests.unit.shard.engine.test_batch import batch_of, request
from tests.unit.shard.engine.test_engine import Run
from tests.unit.shard.models.test_models import _free_port

PROMPTS = ([12, 40, 77, 9, 150, 33, 21], [5, 98, 61, 200, 14], [44, 17, 120, 63, 8, 91, 30, 11])


def _requests() -> list[pb.Request]:
    return [request(10 + i, p, max_new=6, ignore_eos=True, adapter_index=i)
            for i, p in enumerate(PROMPTS)]


def _mixed_run(model: Path, spec: str, rank: int = 0, world_size: int = 1, port: int = 29500
               ) -> Run:
    engine = load_engine(ShardSettings(model_path=model, block_size=4, rank=rank,
                                       world_size=world_size, master_port=port,
                                       lora_adapters=spec))
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=128, max_batch_total_tokens=1024))
    run = Run(engine)
    first, second, base = _requests()
    cached = run.prefill(batch_of(first, base, batch_id=1))
    assert cached is not None
    run.finish(run.prefill(batch_of(second, batch_id=2), run.decode(cached)))
    return run


def _rank_main(rank: int, port: int, served: Callable[..., Run], model: Path, arg: object,
               out: Path) -> None:
    """One of two ranks: `served(model, arg, rank, 2, port)`'s tokens and logprobs saved."""
    torch.set_num_threads(1)
    run = served(model, arg, rank, 2, port)
    try:
        torch.save((run.tokens, run.logprobs), out / f"rank{rank}.pt")
    finally:
        run.engine.dist.close()


def two_ranks(served: Callable[..., Run], model: Path, arg: object, out: Path
              ) -> list[tuple[dict[int, list[int]], dict[int, torch.Tensor]]]:
    """Each of two gloo ranks' (tokens, logprobs) by request id, `served` running on both."""
    mp.spawn(_rank_main, args=(_free_port(), served, model, arg, out), nprocs=2, join=True)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


def assert_like_one_rank(ranks: list[tuple[dict[int, list[int]], dict[int, torch.Tensor]]],
                         expected: Run) -> None:
    """Every rank's tokens are one rank's, its logprobs within float tolerance; the rows
    differ from each other, so a rank that ignored the adapters would fail."""
    assert len({tuple(t) for t in expected.tokens.values()}) == len(expected.tokens)
    for tokens, logprobs in ranks:
        assert tokens == expected.tokens
        for rid, lps in expected.logprobs.items():
            torch.testing.assert_close(logprobs[rid], lps, rtol=1e-4, atol=1e-4)


def test_two_ranks_serve_a_mixed_batch_like_one(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    model = tiny_model("llama")
    alpha = write_adapter(tmp_path / "alpha", model, rank=8, alpha=16, seed=5)
    beta = write_adapter(tmp_path / "beta", model, rank=4, alpha=8, rslora=True, seed=6,
                         modules=("k_proj", "o_proj", "up_proj", "down_proj"))
    spec = f"alpha={alpha},beta={beta}"
    ranks = two_ranks(_mixed_run, model, spec, tmp_path)
    assert_like_one_rank(ranks, _mixed_run(model, spec))
