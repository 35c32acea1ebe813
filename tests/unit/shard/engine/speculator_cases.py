"""What the speculator tests (the draft model, Medusa heads, the MLP speculator, the families)
share: an engine built with a speculator, requests served through SpeculatingRouter with the
drafts counted and compared with a run without speculation, the drafter watched for proposing
each row's newest token, and one rank of a two-rank tensor-parallel run. Kept here so every
drafter is held to the same checks, written once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.batch import Batch
from pytgi_shard.engine.drafting import Drafts
from pytgi_shard.engine.engine import Engine
from pytgi_shard.engine.hidden_drafter import HiddenStateDrafter
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import ShardSettings
from tests.unit.shard.engine.test_engine import Run
from tests.unit.shard.engine.test_speculation import SpeculatingRouter, greedy
from tests.unit.shard.router_steps import prompt_of

SPECULATE = 3
BLOCK = 4


def build(model: Path, speculate: int = 0, draft: Path | None = None, **fields: object) -> Engine:
    fields.setdefault("attention", "reference")
    engine = load_engine(ShardSettings(
        model_path=model, block_size=BLOCK, overlap=False,
        speculate=speculate, speculator_model=draft, **fields,  # type: ignore[arg-type]
    ))
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=128, max_batch_total_tokens=4096))
    engine.drafting_batch = 64
    return engine


class Served:
    """A run through SpeculatingRouter with the drafts proposed and kept counted."""

    def __init__(self, engine: Engine) -> None:
        self.router = SpeculatingRouter(engine)
        self.drafted = self.kept = 0

    @property
    def run(self) -> Run:
        return self.router.run

    def prefill(self, batch_id: int, r: pb.Request, start: int, size: int) -> None:
        self.router.prefill(batch_id, [self.router.chunk(r, start, size)])

    def finish(self) -> None:
        while self.router.cached is not None:
            response = self.router.decode()
            self.drafted += response.drafted_tokens
            self.kept += sum(len(g.tokens.ids) - 1 for g in response.generations)


def serve(engine: Engine, reqs: list[pb.Request], chunk: int = 0,
          prefix: dict[int, list[int]] | None = None) -> Served:
    """Each request prefilled (in chunks of `chunk` tokens when given; after `prefix[id]`'s
    blocks, cached, when given), all decoded together to the end."""
    served = Served(engine)
    for r in reqs:
        total = len(r.input_ids) + len(r.generated_ids)
        start = 0
        if prefix and r.id in prefix:
            served.router.blocks[r.id] = list(prefix[r.id])
            served.router.next_block = max(served.router.next_block, max(prefix[r.id]) + 1)
            start = len(prefix[r.id]) * BLOCK
        size = chunk or total
        while start < total:
            served.prefill(100 + r.id * 50 + start, r, start, size)
            start += size
    served.finish()
    return served


def assert_same(got: Run, expected: Run) -> None:
    assert got.tokens == expected.tokens
    for rid, lps in expected.logprobs.items():
        torch.testing.assert_close(got.logprobs[rid], lps, rtol=1e-4, atol=1e-4)
        assert got.finals[rid].text == expected.finals[rid].text
        assert got.finals[rid].finish_reason == expected.finals[rid].finish_reason


def requests(sampling: bool = True) -> list[pb.Request]:
    """Greedy requests and, when `sampling`, a seeded sampling one (whose drafts, the draft's
    argmax, the target's draws keep only when they agree)."""
    params = pb.NextTokenChooserParameters(do_sample=True, seed=5, top_k=20)
    return [
        greedy(0, prompt_of(12, 0) * 2, 24),
        greedy(1, prompt_of(11, 1), 21, top_n_tokens=2),
        *([greedy(2, prompt_of(9, 2), 12, parameters=params)] if sampling else []),
    ]


def watch_newest_token_drafts(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Wraps the engine's hidden-state drafter so that each proposal records whether every
    draft of its row is that row's newest token; drafters built to copy their input (identity
    heads, copying stages) must propose exactly that, which proves which state they read."""
    drafter = engine.drafter
    assert isinstance(drafter, HiddenStateDrafter)
    propose = drafter.propose
    seen: list[bool] = []

    def checked(batch: Batch, asks: list[tuple[int, int]]) -> Drafts | None:
        drafts = propose(batch, asks)
        if drafts is not None:
            last = batch.last_ids.tolist()
            seen.extend(set(t) == {last[row]} for row, t in zip(drafts.rows, drafts.tokens,
                                                                strict=True))
        return drafts

    monkeypatch.setattr(drafter, "propose", checked)
    return seen


def rank_file(out: Path, rank: int, speculator: Path) -> Path:
    """Where `serve_on_rank` leaves one rank's run for the speculator at `speculator`."""
    return out / f"rank{rank}-{speculator.name}.pt"


def serve_on_rank(rank: int, port: int, target: Path, speculator: Path, out: Path,
                  sampling: bool) -> None:
    """One gloo rank of two (mp.spawn's target): `requests(sampling)` served with speculation
    in chunks of 6, its tokens, logprobs and draft counts saved at `rank_file`."""
    torch.set_num_threads(1)
    engine = load_engine(ShardSettings(
        model_path=target, block_size=BLOCK, rank=rank, world_size=2, master_port=port,
        speculate=SPECULATE, speculator_model=speculator, attention="reference",
    ))
    try:
        engine.warmup(pb.WarmupRequest(max_prefill_tokens=64, max_batch_total_tokens=1024))
        engine.drafting_batch = 64
        served = serve(engine, requests(sampling), chunk=6)
        torch.save((served.run.tokens, served.run.logprobs, served.drafted, served.kept),
                   rank_file(out, rank, speculator))
    finally:
        engine.dist.close()


def assert_ranks_served(plain: Engine, out: Path, speculator: Path,
                        sampling: bool) -> list[tuple[int, int]]:
    """Both ranks served the one-rank plain engine's tokens and logprobs, with drafts; returns
    each rank's (drafted, kept) counts for checks of the caller's own."""
    expected = serve(plain, requests(sampling), chunk=6).run
    counts = []
    for rank in range(2):
        tokens, logprobs, drafted, kept = torch.load(rank_file(out, rank, speculator))
        assert tokens == expected.tokens
        for rid, lps in expected.logprobs.items():
            torch.testing.assert_close(logprobs[rid], lps, rtol=1e-4, atol=1e-4)
        assert drafted > 0
        counts.append((drafted, kept))
    return counts


def assert_chunked_and_resumed_served(plain: Engine, engine: Engine) -> Served:
    """A request prefilled in chunks of 7 and one resumed after 11 generated tokens, both
    served by `engine` as by `plain` (the resumed one ends as the whole run does); returns
    `engine`'s run for the caller's draft counts."""
    whole = serve(plain, [greedy(0, prompt_of(10, 3) * 2, 30)]).run.tokens[0]
    reqs = [greedy(1, prompt_of(10, 3) * 2, 30),
            greedy(2, prompt_of(10, 3) * 2, 30, generated_ids=whole[:11])]
    got = serve(engine, reqs, chunk=7)
    assert_same(got.run, serve(plain, reqs, chunk=7).run)
    assert got.run.tokens[2] == whole[11:]
    return got
