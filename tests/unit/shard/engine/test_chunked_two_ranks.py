"""Chunked prefill, a mixed Prefill, BlockGrants and a resume on two tensor-parallel ranks
(gloo, one process each, as `pytgi-shard serve` runs them): both ranks answer with the tokens
of one rank running every request whole. Their Warmup measures the prefill budget
(shard/engine/prefill_ladder.py): they agree on every rung, so they choose alike."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import ShardSettings
from tests.unit.shard.models.test_models import _free_port
from tests.unit.shard.router_steps import (
    BLOCK,
    Router,
    build_engine,
    chunked,
    prompt_of,
    reference_run,
    request,
)


def requests() -> list[pb.Request]:
    sampled = pb.NextTokenChooserParameters(do_sample=True, seed=3, temperature=1.1)
    resumed = request(3, prompt_of(4, 3), max_new=7, blocks=[], parameters=sampled)
    resumed.generated_ids[:] = [40, 41]
    return [
        request(1, prompt_of(13, 1), max_new=6, blocks=[]),
        request(2, prompt_of(6, 2), max_new=5, blocks=[], parameters=sampled),
        resumed,
    ]


def _rank_main(rank: int, port: int, model: Path, out: Path) -> None:
    torch.set_num_threads(1)
    settings = ShardSettings(
        model_path=model, block_size=BLOCK, rank=rank, world_size=2, master_port=port
    )
    engine = load_engine(settings)
    try:
        warmed = engine.warmup(pb.WarmupRequest(max_batch_total_tokens=1024))
        a, b, c = requests()
        router = Router(engine)
        chunked(router, [a], 5, itertools.count(1).__next__)
        router.decode()
        router.prefill(10, [router.chunk(b, 0, 4)])
        router.prefill(11, [router.chunk(b, 4, 0), router.chunk(c, 0, 0)])
        router.finish()
        torch.save((router.run.tokens, router.run.logprobs, warmed.prefill_sizing),
                   out / f"rank{rank}.pt")
    finally:
        engine.dist.close()


def test_two_ranks_chunk_mix_grow_and_resume_like_one(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    model = tiny_model("llama", sharded=True)
    mp.spawn(_rank_main, args=(_free_port(), model, tmp_path), nprocs=2, join=True)
    expected = reference_run(build_engine(model), requests())
    sizings = set()
    for rank in range(2):
        tokens, logprobs, sizing = torch.load(tmp_path / f"rank{rank}.pt")
        sizings.add(sizing)
        assert tokens == expected.tokens
        for rid, lps in expected.logprobs.items():
            torch.testing.assert_close(logprobs[rid], lps, rtol=1e-4, atol=1e-4)
    # The same rungs, throughputs (each the slowest rank's) and choice on both ranks.
    assert len(sizings) == 1 and "prefill throughput measured at" in sizings.pop()


def _slow_rank_main(rank: int, port: int, model: Path, out: Path) -> None:
    """Rank 0 idles 1.6 s after the first timed prefill of the ladder (its second warmup
    prefill: the first rung starts with an untimed one). On its own clock it would stop that
    rung's repeats at once (1.6 s > 3 x 0.5 s), while rank 1, which waits for it only inside
    the next prefill's collectives, has counted a few milliseconds and runs a second."""
    torch.set_num_threads(1)
    settings = ShardSettings(
        model_path=model, block_size=BLOCK, rank=rank, world_size=2, master_port=port
    )
    engine = load_engine(settings)
    try:
        if rank == 0:
            run, calls = engine._run_warmup_batch, itertools.count(1)

            def slow(batch: pb.Batch) -> None:
                run(batch)
                if next(calls) == 2:
                    time.sleep(1.6)

            engine._run_warmup_batch = slow  # type: ignore[method-assign]
        warmed = engine.warmup(pb.WarmupRequest(max_batch_total_tokens=1024))
        torch.save(warmed.prefill_sizing, out / f"slow{rank}.pt")
    finally:
        engine.dist.close()


def test_ranks_of_unequal_speed_run_the_same_ladder(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """Every rank stops a rung's repeats on the slowest rank's time, so they run the same
    prefills (a rank stopping on its own clock left the other in a collective until gloo's
    timeout)."""
    model = tiny_model("llama", sharded=True)
    mp.spawn(_slow_rank_main, args=(_free_port(), model, tmp_path), nprocs=2, join=True)
    sizings = {torch.load(tmp_path / f"slow{rank}.pt") for rank in range(2)}
    assert len(sizings) == 1 and "prefill throughput measured at" in sizings.pop()
