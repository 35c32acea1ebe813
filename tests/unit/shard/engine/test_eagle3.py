"""The EAGLE-3 drafter (--speculator-model with an EAGLE-3 head): detected from config.json;
a random head's proposals are those of EAGLE-3's draft forward written out in plain PyTorch
(tests/unit/shard/engine/eagle3_oracle.py), step after step, across chunked prefill, a
prefix-cache hit and a resumed request; the greedy tokens served with it equal those served
without speculation, on one rank and two; a head built to propose one token keeps drafts, and
a stop sequence met inside a kept run ends the request where a plain run does; the memory rule;
misfit heads and targets are refused in one line."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.batch import Batch
from pytgi_shard.engine.drafting import Drafts
from pytgi_shard.engine.eagle3 import Eagle3Drafter
from pytgi_shard.engine.engine import Engine
from pytgi_shard.models.llama.eagle3_head import default_aux_layers
from pytgi_shard.service.startup import StartupRefused, load_engine
from pytgi_shard.settings import ShardSettings
from tests.unit.shard.engine.eagle3_oracle import HIDDEN, Oracle, head_config, write_head
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
from tests.unit.shard.engine.test_speculation import greedy, stop_inside_a_kept_run
from tests.unit.shard.models.test_models import _free_port
from tests.unit.shard.router_steps import prompt_of

# The tiny Llama's greedy run on prompt_of(10, 0) * 3 repeats this token from its 7th on.
REPEATED = 67


@pytest.fixture(scope="module")
def heads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eagle3")
    return {
        "shared": write_head(root / "shared", seed=0),
        "own": write_head(root / "own", seed=1, own_embed=True),
        "constant": write_head(root / "constant", seed=2, constant=REPEATED),
    }


@pytest.fixture(scope="module")
def engines(tiny_model: Callable[..., Path], heads: dict[str, Path]) -> Iterator[dict[str, Engine]]:
    target = tiny_model("llama")
    yield {"plain": build(target), **{k: build(target, SPECULATE, p) for k, p in heads.items()}}


def watch_proposals(engine: Engine,
                    monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], list[int]]]:
    """Each proposal of the engine's drafter as (the row's tokens, its drafts)."""
    drafter = engine.drafter
    assert isinstance(drafter, Eagle3Drafter)
    propose = drafter.propose
    seen: list[tuple[list[int], list[int]]] = []

    def watched(batch: Batch, asks: list[tuple[int, int]]) -> Drafts | None:
        drafts = propose(batch, asks)
        if drafts is not None:
            for row, tokens in zip(drafts.rows, drafts.tokens, strict=True):
                length = batch.requests[row].length
                seen.append((batch.all_ids[row, :length].tolist(), list(tokens)))
        return drafts

    monkeypatch.setattr(drafter, "propose", watched)
    return seen


@pytest.mark.parametrize("head", ["shared", "own"])
def test_proposals_are_eagle3_s_draft_forward(
    engines: dict[str, Engine], heads: dict[str, Path], tiny_model: Callable[..., Path],
    head: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every proposal, of every step (the first drafts from a whole caught-up prompt, then
    from the kept tokens' catch-up; chunked prefill, a resumed request), is the oracle's."""
    engine = engines[head]
    seen = watch_proposals(engine, monkeypatch)
    reqs = [greedy(0, prompt_of(12, 7) * 2, 24), greedy(1, prompt_of(9, 8), 24)]
    whole = serve(engines["plain"], [greedy(2, prompt_of(10, 3) * 2, 30)]).run.tokens[2]
    reqs.append(greedy(2, prompt_of(10, 3) * 2, 30, generated_ids=whole[:7]))
    assert_same(serve(engine, reqs, chunk=5).run, serve(engines["plain"], reqs, chunk=5).run)
    oracle = Oracle(tiny_model("llama"), heads[head])
    assert len(seen) >= 8
    for sequence, drafts in seen:
        assert drafts == oracle.drafts(sequence, len(drafts)), sequence
    assert len({tuple(d) for _, d in seen}) > 3, "a random head's drafts vary"


@pytest.mark.parametrize("head", ["shared", "own"])
def test_served_greedy_tokens_equal_those_without_speculation(
    engines: dict[str, Engine], head: str
) -> None:
    engine = engines[head]
    assert isinstance(engine.drafter, Eagle3Drafter) and engine.drafter.name == "eagle3"
    got = serve(engine, requests())
    assert_same(got.run, serve(engines["plain"], requests()).run)
    assert got.drafted > 0
    assert_chunked_and_resumed_served(engines["plain"], engine)


def test_a_prefix_cache_hit_reads_the_states_its_blocks_were_computed_with(
    engines: dict[str, Engine], heads: dict[str, Path], tiny_model: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request in a batch that does not draft computes a prompt's blocks; a request reusing
    them as a prefix-cache hit catches its head cache up from the fused states the target
    stored with those blocks (the head cache wiped first): its drafts are still the oracle's."""
    engine = engines["shared"]
    prompt = prompt_of(10, 4) * 2
    engine.drafting_batch = 0
    try:
        first = serve(engine, [greedy(7, prompt, 4)])
    finally:
        engine.drafting_batch = 64
    assert first.drafted == 0
    cached = first.router.blocks[7][: len(prompt) // BLOCK - 1]
    drafter = engine.drafter
    assert isinstance(drafter, Eagle3Drafter)
    with torch.inference_mode():
        for t in drafter.kv_cache.keys + drafter.kv_cache.values:
            t.normal_()
    seen = watch_proposals(engine, monkeypatch)
    hit = greedy(8, prompt, 16)
    got = serve(engine, [hit], prefix={8: cached})
    assert_same(got.run, serve(engines["plain"], [hit]).run)
    assert got.drafted > 0
    oracle = Oracle(tiny_model("llama"), heads["shared"])
    assert seen and all(d == oracle.drafts(s, len(d)) for s, d in seen)


def test_a_head_that_proposes_the_repeated_token_keeps_drafts_and_stops_inside_a_kept_run(
    engines: dict[str, Engine],
) -> None:
    """The constant head proposes REPEATED through its d2t map (draft id 0): on a prompt whose
    greedy run repeats it, drafts are kept, several per step; a stop sequence met inside a
    kept run ends the request at the token a plain run ends at."""
    engine, plain = engines["constant"], engines["plain"]
    prompt = prompt_of(10, 0) * 3
    got = serve(engine, [greedy(0, prompt, 24)])
    tokens = got.run.tokens[0]
    assert tokens == serve(plain, [greedy(0, prompt, 24)]).run.tokens[0]
    assert tokens.count(REPEATED) > 12
    assert got.kept >= 10 and got.kept <= got.drafted
    stop, end = stop_inside_a_kept_run(got.run.generations[0], tokens, plain.detokenizer)
    reqs = [greedy(1, prompt, 24, stop=[stop])]
    stopped = serve(engine, reqs, chunk=7).run
    assert_same(stopped, serve(plain, reqs, chunk=7).run)
    assert stopped.tokens[1] == tokens[:end]
    assert stopped.finals[1].finish_reason == pb.FINISH_REASON_STOP_SEQUENCE


def test_the_head_cache_and_store_have_the_target_s_blocks(engines: dict[str, Engine]) -> None:
    runner = engines["shared"].runner
    drafter = runner.eagle
    assert drafter is not None and runner.hidden_tap is drafter
    assert drafter.kv_cache.num_blocks == runner.kv_cache.num_blocks > 1
    assert drafter.store.shape == (runner.kv_cache.num_blocks * BLOCK, HIDDEN)
    assert drafter.catch_up_tokens == 128
    # Its KV (one layer: 2 KV heads of 16, keys and values) and a fused state per token, fp32.
    assert drafter.bytes_per_token() == (2 * 2 * 16 + HIDDEN) * 4
    assert runner.decode_graphs is None


def test_default_target_layers() -> None:
    assert default_aux_layers(32) == (2, 16, 29)
    assert default_aux_layers(3) == (2, 1, 0)


def test_start_up_refusals(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    target = tiny_model("llama")

    def refused(path: Path, match: str, model: Path = target) -> None:
        with pytest.raises(StartupRefused, match=match) as e:
            load_engine(ShardSettings(model_path=model, speculate=2, speculator_model=path))
        assert "\n" not in str(e.value) and str(path) in str(e.value)

    # EAGLE-3's default layers (2, 1, -1) do not fit a 2-layer target.
    refused(write_head(tmp_path / "default", aux=None), r"default target layers \(2, 1, -1\)")
    refused(write_head(tmp_path / "same", aux=[1, 1, 2]), "not three distinct layers")
    missing = write_head(tmp_path / "missing")
    tensors = load_file(str(missing / "model.safetensors"))
    del tensors["midlayer.hidden_norm.weight"]
    save_file(tensors, str(missing / "model.safetensors"))
    refused(missing, "no tensor midlayer.hidden_norm.weight")
    narrow = write_head(tmp_path / "narrow")
    tensors = load_file(str(narrow / "model.safetensors"))
    save_file({**tensors, "fc.weight": torch.zeros(HIDDEN, 2 * HIDDEN)},
              str(narrow / "model.safetensors"))
    refused(narrow, f"its fc takes {2 * HIDDEN} features; 3 x the target's hidden size is "
                    f"{3 * HIDDEN}")
    vocab = write_head(tmp_path / "vocab")
    (vocab / "config.json").write_text(json.dumps(head_config(vocab_size=1000)))
    refused(vocab, "its vocab_size 1000 is not the target's 384")
    wide = write_head(tmp_path / "wide")
    tensors = load_file(str(wide / "model.safetensors"))
    save_file({**tensors, "d2t": tensors["d2t"] + 400}, str(wide / "model.safetensors"))
    refused(wide, "d2t maps draft ids outside the target's 384 tokens")
    refused(write_head(tmp_path / "gpt2", aux=[0, 1, 2]), "Llama-style decoders",
            model=tiny_model("gpt2"))
    converted = write_head(tmp_path / "converted")
    (converted / "config.json").write_text(json.dumps(
        {**head_config(), "architectures": ["Eagle3Speculator"],
         "speculators_model_type": "eagle3"}))
    refused(converted, r"speculators library's format \(eagle3\) is not read")


def test_two_ranks_draft_like_one(
    tiny_model: Callable[..., Path], tmp_path: Path, engines: dict[str, Engine],
    heads: dict[str, Path],
) -> None:
    """The target sharded over two gloo ranks, the head replicated and sharing the target's
    tensor-parallel embedding: every rank serves the one-rank plain engine's tokens."""
    target = tiny_model("llama", sharded=True)
    mp.spawn(serve_on_rank, args=(_free_port(), target, heads["shared"], tmp_path, True),
             nprocs=2, join=True)
    assert_ranks_served(engines["plain"], tmp_path, heads["shared"], sampling=True)


def test_the_head_runs_on_the_triton_attention(
    tiny_model: Callable[..., Path], engines: dict[str, Engine], heads: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The head's catch-up (a subset of the batch's block tables) and one-position steps
    through the Triton kernels (Triton's interpreter on the CPU): the oracle's drafts, the
    reference's tokens."""
    pytest.importorskip("triton", reason="triton is not installed")
    target = tiny_model("llama")
    engine = build(target, SPECULATE, heads["shared"], attention="triton")
    assert engine.info().attention_impl == "triton"
    seen = watch_proposals(engine, monkeypatch)
    reqs = [greedy(0, prompt_of(6, 5) * 2, 8), greedy(1, prompt_of(5, 6), 6)]
    assert_same(serve(engine, reqs, chunk=7).run, serve(engines["plain"], reqs).run)
    oracle = Oracle(target, heads["shared"])
    assert seen and all(d == oracle.drafts(s, len(d)) for s, d in seen)


def test_a_qwen2_target(
    tiny_model: Callable[..., Path], heads: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another family of the Llama-style decoder (Qwen2: q/k/v biases, tied embeddings, which
    the head shares): the oracle's drafts, the plain engine's tokens."""
    target = tiny_model("qwen2")
    engine = build(target, SPECULATE, heads["shared"])
    seen = watch_proposals(engine, monkeypatch)
    reqs = [greedy(0, prompt_of(12, 7) * 2, 16), greedy(1, prompt_of(9, 8), 16)]
    assert_same(serve(engine, reqs, chunk=6).run, serve(build(target), reqs, chunk=6).run)
    oracle = Oracle(target, heads["shared"])
    assert len(seen) >= 4 and all(d == oracle.drafts(s, len(d)) for s, d in seen)
