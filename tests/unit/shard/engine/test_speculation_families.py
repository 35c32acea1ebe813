"""Speculation for every family of the registry (issue 30's greedy equality, family by family).

Each tiny model of tests/tiny_models.py (Llama's family, the Llama-style decoders with their
windows, soft caps and multipliers, the mixtures of experts, the GPT-style decoders with learned
positions and ALiBi, and the transformers fallback) served with --speculate 4 (n-gram drafts)
gives the greedy tokens, logprobs and top tokens it gives without speculation, on one rank and on
two (one gloo spawn for all the families); the prompts repeat a phrase, so tiny random models
loop and drafts are proposed and kept in every family, or the equality would prove nothing. The
target as its own draft model (--speculator-model) keeps every draft in every family. An
encoder-decoder takes --speculate, logs that it does not speculate, and serves as without.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.multiprocessing as mp

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.device.distributed import init_distributed
from pytgi_shard.engine.engine import Engine
from pytgi_shard.models import MODELS
from pytgi_shard.models.transformers_model import TransformersModel
from pytgi_shard.service import startup
from pytgi_shard.settings import ShardSettings
from tests.tiny_models import (
    DECODER_FAMILIES,
    FALLBACK,
    GPT_FAMILIES,
    LLAMA_FAMILY,
    MOE_FAMILIES,
    build_model,
)
from tests.unit.shard.engine.speculator_cases import Served, assert_same, serve
from tests.unit.shard.engine.test_engine import Run
from tests.unit.shard.engine.test_speculation import greedy
from tests.unit.shard.models.test_models import CPU, _free_port
from tests.unit.shard.router_steps import prompt_of

SPECULATE = 4
BLOCK = 4
# pytgi's own decoders, every one that tests/tiny_models.py builds; they shard over two ranks.
DECODERS = [*LLAMA_FAMILY, *DECODER_FAMILIES, *MOE_FAMILIES, *GPT_FAMILIES]
# An architecture only the transformers fallback serves (one rank: it cannot shard).
(FALLBACK_FAMILY,) = FALLBACK
# Prefill chunks of the runs that chunk: prompts of 15 to 24 tokens in 3 or 4 of them.
CHUNK = 7
# The std of the random matrices of the families whose default one is too small to tell.
SHARP = {"cohere": 0.2}
# Greedy tokens of requests[TOP] carry top tokens, compared too.
TOP = 2


def requests() -> list[pb.Request]:
    """Prompts that repeat a phrase, on which the tiny random models loop (drafts proposed and
    kept): a 6-token phrase, and a 3-token one for the families whose sliding windows (5 and 6
    tokens) forget a longer one; one with top tokens; one that repeats nothing."""
    return [
        greedy(0, prompt_of(6, 0) * 4, 20),
        greedy(1, prompt_of(3, 9) * 6, 20),
        greedy(TOP, prompt_of(5, 1) * 3, 16, top_n_tokens=2),
        greedy(3, prompt_of(9, 2), 12),
    ]


def build(model: Path, speculate: int, draft: Path | None = None) -> Engine:
    """An engine as a shard builds it (load_engine), every batch drafting."""
    engine = startup.load_engine(ShardSettings(
        model_path=model, block_size=BLOCK, overlap=False, attention="reference",
        speculate=speculate, speculator_model=draft,
    ))
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=64, max_batch_total_tokens=1024))
    engine.drafting_batch = 64
    return engine


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: tiny tensors gain nothing from more, and on a busy machine their
    threads' waiting costs several times the work (4 min instead of 30 s here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model(
    tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """A family's tiny model; Cohere's with sharper weights: at the default std its q/k norms
    leave attention so nearly uniform that drafts fed at wrong positions move its logprobs
    less than the tolerance (checked by feeding them one position late)."""
    root = tmp_path_factory.mktemp("sharp")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in SHARP:
            return tiny_model(family)
        if family not in built:
            built[family] = build_model(root / family, family, std=SHARP[family])
        return built[family]

    return get


@pytest.fixture(scope="module")
def plain(model: Callable[[str], Path]) -> Iterator[Callable[[str], Run]]:
    """A family's run without speculation (one rank), served once for every test here."""
    runs: dict[str, Run] = {}

    def get(family: str) -> Run:
        if family not in runs:
            runs[family] = serve(build(model(family), 0), requests()).run
        return runs[family]

    yield get


def assert_served_alike(got: Served, expected: Run, family: str) -> None:
    try:
        assert_same(got.run, expected)
        tops = [[list(t.ids) for g in run.generations[TOP] for t in g.top_tokens]
                for run in (expected, got.run)]
        assert tops[0] == tops[1] and len(tops[0]) == 16
    except AssertionError as e:
        raise AssertionError(f"{family}: {e}") from e


def test_every_registered_family_is_here() -> None:
    """A family added to the registry and to tests/tiny_models.py is proven here too."""
    assert set(DECODERS) <= set(MODELS) and FALLBACK_FAMILY not in MODELS


@pytest.mark.parametrize("family", [*DECODERS, FALLBACK_FAMILY])
def test_ngram_drafts_serve_the_tokens_served_without(
    model: Callable[[str], Path], plain: Callable[[str], Run], family: str
) -> None:
    engine = build(model(family), SPECULATE)
    # The fallback speculates as pytgi's own models do: it runs the same flat paged step.
    assert isinstance(engine.runner.model, TransformersModel) == (family == FALLBACK_FAMILY)
    got = serve(engine, requests())
    assert_served_alike(got, plain(family), family)
    assert got.kept > 0, f"{family} kept no draft: the prompts no longer make it repeat itself"


@pytest.mark.parametrize("family", [*DECODERS, FALLBACK_FAMILY])
def test_the_target_as_its_own_draft_model_keeps_every_draft(
    model: Callable[[str], Path], plain: Callable[[str], Run], family: str
) -> None:
    """The draft model's paged KV, positions, windows and catch-up are the target's: its
    argmax is the target's, so every draft is kept (and the tokens, prompts prefilled in
    chunks, are those without)."""
    path = model(family)
    got = serve(build(path, SPECULATE, draft=path), requests(), chunk=CHUNK)
    assert_served_alike(got, plain(family), family)
    assert got.kept == got.drafted > 0


def test_an_encoder_decoder_takes_speculate_and_serves_without_drafting(
    tiny_model: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    """T5's decoder steps are not the varlen path verification takes: --speculate is logged
    and set aside (/info reports 0, so the router holds no draft slots), the tokens are
    those without it."""
    path = tiny_model("t5")
    with caplog.at_level(logging.WARNING, logger=startup.__name__):
        engine = build(path, SPECULATE)
    assert "--speculate 4: t5 is an encoder-decoder, which does not speculate" in caplog.text
    assert engine.speculate == 0 and engine.info().speculate == 0
    got = serve(engine, requests())
    assert_served_alike(got, serve(build(path, 0), requests()).run, "t5")
    assert got.drafted == 0 and got.kept == 0


def _rank_main(rank: int, port: int, paths: list[Path], out: Path) -> None:
    torch.set_num_threads(1)  # two ranks on a small machine: no oversubscription
    dist = init_distributed(rank, 2, "127.0.0.1", port, CPU)
    try:
        results = {}
        # Every family's engine joins this one process group (load_engine would make one each).
        with mock.patch.object(startup, "init_distributed", return_value=dist):
            for path in paths:
                engine = startup.load_engine(ShardSettings(
                    model_path=path, block_size=BLOCK, rank=rank, world_size=2,
                    overlap=False, attention="reference", speculate=SPECULATE,
                ))
                engine.warmup(pb.WarmupRequest(max_prefill_tokens=64, max_batch_total_tokens=1024))
                engine.drafting_batch = 64
                served = serve(engine, requests(), chunk=CHUNK)
                results[path.name] = (served.run.tokens, served.run.logprobs, served.kept)
        torch.save(results, out / f"rank{rank}.pt")
    finally:
        dist.close()


def test_every_family_on_two_ranks_drafts_and_serves_as_one_rank_without(
    model: Callable[[str], Path], plain: Callable[[str], Run], tmp_path: Path
) -> None:
    """world_size 2 over gloo (heads, MLP, experts and vocabulary split, verification's
    varlen step on every rank), one spawn for all the families, prompts prefilled in chunks:
    every rank serves the tokens one rank serves without speculation, and keeps drafts."""
    paths = [model(family) for family in DECODERS]
    mp.spawn(_rank_main, args=(_free_port(), paths, tmp_path), nprocs=2, join=True)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for family in DECODERS:
            tokens, logprobs, kept = results[family]
            expected = plain(family)
            assert tokens == expected.tokens, f"{family} on rank {rank}"
            for rid, lps in expected.logprobs.items():
                try:
                    torch.testing.assert_close(logprobs[rid], lps, rtol=1e-4, atol=1e-4)
                except AssertionError as e:
                    raise AssertionError(f"{family} on rank {rank}: {e}") from e
            assert kept > 0, f"{family} on rank {rank} kept no draft"
