"""The draft model (--speculator-model): greedy tokens served with its drafts equal those served
without speculation, for a draft that agrees with the target (the target itself: every draft
kept, which also proves its KV cache right) and one that does not (another family's random
weights: few kept), across chunked prefill, a prefix-cache hit on blocks no draft ever wrote, a
resumed request and two tensor-parallel ranks; the memory rule; the start-up refusals."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from pytgi_shard.engine import warmup
from pytgi_shard.engine.draft_model import DraftModel
from pytgi_shard.engine.engine import Engine
from pytgi_shard.engine.warmup import Limits, cache_blocks
from pytgi_shard.service.startup import StartupRefused, load_engine
from pytgi_shard.settings import ShardSettings
from tests.tiny_models import build_model, train_tokenizer, write_tokenizer
from tests.unit.shard.engine.speculator_cases import (
    BLOCK,
    SPECULATE,
    assert_chunked_and_resumed_served,
    assert_ranks_served,
    assert_same,
    build,
    requests,
    serve,
    serve_on_rank,
)
from tests.unit.shard.engine.test_speculation import greedy
from tests.unit.shard.models.test_models import _free_port
from tests.unit.shard.router_steps import prompt_of


@pytest.fixture(scope="module")
def engines(tiny_model: Callable[..., Path]) -> Iterator[dict[str, Engine]]:
    target = tiny_model("llama")
    yield {
        "plain": build(target),
        "self": build(target, SPECULATE, target),
        "other": build(target, SPECULATE, tiny_model("qwen2")),
    }


@pytest.mark.parametrize("draft", ["self", "other"])
def test_served_greedy_tokens_equal_those_without_speculation(
    engines: dict[str, Engine], draft: str
) -> None:
    expected = serve(engines["plain"], requests())
    got = serve(engines[draft], requests())
    assert_same(got.run, expected.run)
    assert got.drafted > 0
    greedy_only = serve(engines[draft], requests(sampling=False))
    if draft == "self":
        # The target drafting for itself agrees with its greedy self: every draft is kept.
        assert greedy_only.kept == greedy_only.drafted > 0
    else:
        assert greedy_only.kept < greedy_only.drafted / 2, "random weights rarely agree"


@pytest.mark.parametrize("draft", ["self", "other"])
def test_chunked_prefill_and_a_resumed_request(engines: dict[str, Engine], draft: str) -> None:
    got = assert_chunked_and_resumed_served(engines["plain"], engines[draft])
    if draft == "self":
        assert got.drafted > 0 and got.kept == got.drafted


def test_a_prefix_cache_hit_on_blocks_no_draft_wrote(engines: dict[str, Engine]) -> None:
    """A request in a batch that does not draft computes a prompt's blocks in the target's
    cache only; a greedy request reusing them as a prefix-cache hit writes its own draft KV
    for them (DraftState.written starts at 0): its self-drafts are all kept. With the draft
    cache's copy of those blocks trusted, the draft would read KV never written, and miss."""
    engine = engines["self"]
    prompt = prompt_of(10, 4) * 2
    engine.drafting_batch = 0
    try:
        first = serve(engine, [greedy(7, prompt, 4)])
    finally:
        engine.drafting_batch = 64
    assert first.drafted == 0
    cached = first.router.blocks[7][: len(prompt) // BLOCK - 1]
    # The draft cache is wiped: only the request's own writes can make its drafts right.
    assert engine.runner.draft is not None
    with torch.inference_mode():
        for t in engine.runner.draft.kv_cache.keys + engine.runner.draft.kv_cache.values:
            t.normal_()
    hit = greedy(8, prompt, 24)
    expected = serve(engines["plain"], [hit])
    got = serve(engine, [hit], prefix={8: cached})
    assert_same(got.run, expected.run)
    assert got.drafted > 0 and got.kept == got.drafted


def test_the_draft_cache_has_the_target_s_blocks_and_the_memory_rule(
    engines: dict[str, Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = engines["other"].runner
    assert isinstance(runner.draft, DraftModel)
    assert runner.draft.kv_cache.num_blocks == runner.kv_cache.num_blocks > 1
    # The catch-up takes at most the prefill budget Warmup measured with.
    assert runner.draft.catch_up_tokens == 128
    # Without a budget, the KV memory is shared: a block id costs both caches' bytes.
    monkeypatch.setattr(warmup, "_available_ram", lambda: 2**24)
    model, settings = runner.model, runner.settings
    limits = Limits(128, 0, 0, 0, 0)
    alone = cache_blocks(limits, model, BLOCK, settings, 0)
    target_bytes = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 4
    draft_bytes = runner.draft.bytes_per_token()
    shared = cache_blocks(limits, model, BLOCK, settings, 0, draft_bytes)
    assert shared == pytest.approx(alone * target_bytes / (target_bytes + draft_bytes), rel=0.01)


def test_start_up_refusals(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    target = tiny_model("llama")
    with pytest.raises(ValueError, match="give --speculate N"):
        ShardSettings(model_path=target, speculator_model=target)
    # Another tokenizer: the same model's weights, a vocabulary trained on other text.
    other = build_model(tmp_path / "other", "llama")
    write_tokenizer(other, train_tokenizer(["entirely different words here"] * 3), 256)
    with pytest.raises(StartupRefused, match="its tokenizer is not the target's"):
        load_engine(ShardSettings(model_path=target, speculate=2, speculator_model=other))
    with pytest.raises(StartupRefused, match="encoder-decoder"):
        load_engine(ShardSettings(model_path=target, speculate=2,
                                  speculator_model=tiny_model("t5")))
    with pytest.raises(StartupRefused, match="no config.json"):
        load_engine(ShardSettings(model_path=target, speculate=2, speculator_model=tmp_path))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_two_ranks_draft_like_one(
    tiny_model: Callable[..., Path], tmp_path: Path, engines: dict[str, Engine], family: str
) -> None:
    """Target and draft both sharded over two gloo ranks: every rank serves the one-rank
    plain engine's tokens; the target as its own draft keeps every draft."""
    target = tiny_model("llama", sharded=True)
    draft = target if family == "llama" else tiny_model(family)
    mp.spawn(serve_on_rank, args=(_free_port(), target, draft, tmp_path, False), nprocs=2,
             join=True)
    counts = assert_ranks_served(engines["plain"], tmp_path, draft, sampling=False)
    if family == "llama":
        assert all(kept == drafted for drafted, kept in counts)


def test_the_draft_runs_on_the_triton_attention(
    tiny_model: Callable[..., Path], engines: dict[str, Engine]
) -> None:
    """The draft's forwards (a catch-up over a subset of the batch's block tables, then
    one-token steps) through the Triton kernels (Triton's interpreter on the CPU): the target as
    its own draft keeps every draft, the tokens are the reference's."""
    pytest.importorskip("triton", reason="triton is not installed")
    target = tiny_model("llama")
    engine = build(target, SPECULATE, target, attention="triton")
    assert engine.info().attention_impl == "triton"
    reqs = [greedy(0, prompt_of(6, 5) * 2, 8), greedy(1, prompt_of(5, 6), 5)]
    expected = serve(engines["plain"], reqs)
    got = serve(engine, reqs, chunk=7)
    assert_same(got.run, expected.run)
    assert got.drafted > 0 and got.kept == got.drafted
