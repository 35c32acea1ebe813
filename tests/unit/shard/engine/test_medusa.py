"""Medusa heads (--speculator-model with TGI's Medusa checkpoint): detected from config.json;
random heads in both layouts (their own output projection, or the target's LM head) give the
greedy tokens served without speculation, across chunked prefill, a resumed request and two
tensor-parallel ranks; heads that reproduce the LM head prove each row's hidden state is the
one of its position L - 2; misfit checkpoints are refused in one line."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

from pytgi_shard.engine.engine import Engine
from pytgi_shard.engine.hidden_drafter import HiddenStateDrafter
from pytgi_shard.service.startup import StartupRefused, load_engine
from pytgi_shard.settings import ShardSettings
from tests.tiny_models import VOCAB_SIZE
from tests.unit.shard.engine.speculator_cases import (
    SPECULATE,
    assert_chunked_and_resumed_served,
    assert_ranks_served,
    assert_same,
    build,
    requests,
    serve,
    serve_on_rank,
    watch_newest_token_drafts,
)
from tests.unit.shard.engine.test_speculation import greedy
from tests.unit.shard.models.test_models import _free_port
from tests.unit.shard.router_steps import prompt_of

HIDDEN = 64  # tests/tiny_models.py's llama
HEADS = 3


def write_heads(path: Path, own_output: bool, scale: float = 0.05, seed: int = 0) -> Path:
    """A Medusa checkpoint in TGI's layout: one residual block per head (scale 0: the identity,
    x + SiLU(0)), and each head's own output projection or none (the target's LM head)."""
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(HEADS):
        tensors[f"{i}.0.linear.weight"] = torch.randn(HIDDEN, HIDDEN, generator=g) * scale
        tensors[f"{i}.0.linear.bias"] = torch.randn(HIDDEN, generator=g) * scale
        if own_output:
            tensors[f"{i}.1.weight"] = torch.randn(VOCAB_SIZE, HIDDEN, generator=g) * 0.1
    save_file(tensors, path / "medusa_lm_head.safetensors")
    (path / "config.json").write_text(json.dumps(
        {"medusa_num_heads": HEADS, "medusa_num_layers": 1, "base_model_name_or_path": "tiny"}))
    return path


@pytest.fixture(scope="module")
def engines(
    tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Engine]]:
    target = tiny_model("llama")
    root = tmp_path_factory.mktemp("medusa")
    yield {
        "plain": build(target),
        "own": build(target, SPECULATE, write_heads(root / "own", True)),
        "lm_head": build(target, SPECULATE, write_heads(root / "lm_head", False)),
        "identity": build(target, SPECULATE, write_heads(root / "identity", False, scale=0.0)),
    }


@pytest.mark.parametrize("heads", ["own", "lm_head"])
def test_served_greedy_tokens_equal_those_without_speculation(
    engines: dict[str, Engine], heads: str
) -> None:
    engine = engines[heads]
    assert isinstance(engine.drafter, HiddenStateDrafter) and engine.drafter.name == "medusa"
    expected = serve(engines["plain"], requests())
    got = serve(engine, requests())
    assert_same(got.run, expected.run)
    assert got.drafted > 0


@pytest.mark.parametrize("heads", ["own", "lm_head"])
def test_chunked_prefill_and_a_resumed_request(engines: dict[str, Engine], heads: str) -> None:
    got = assert_chunked_and_resumed_served(engines["plain"], engines[heads])
    assert got.drafted > 0


def test_each_row_reads_the_hidden_state_of_its_position_before_last(
    engines: dict[str, Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Heads that are the identity followed by the target's LM head propose, from the hidden
    state at position L - 2, the greedy token the target chose there: the row's newest token.
    Any other position's hidden state would propose another token."""
    engine = engines["identity"]
    seen = watch_newest_token_drafts(engine, monkeypatch)
    reqs = [greedy(0, prompt_of(12, 7) * 2, 20), greedy(1, prompt_of(8, 8), 16)]
    expected = serve(engines["plain"], reqs, chunk=5)
    got = serve(engine, reqs, chunk=5)
    assert_same(got.run, expected.run)
    assert len(seen) >= 4 and all(seen)


def test_misfit_checkpoints_are_refused(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    target = tiny_model("llama")
    wrong = write_heads(tmp_path / "wrong", False)
    save_file({"0.0.linear.weight": torch.zeros(8, 8), "0.0.linear.bias": torch.zeros(8)},
              wrong / "medusa_lm_head.safetensors")
    (wrong / "config.json").write_text(json.dumps({"medusa_num_heads": 1}))
    with pytest.raises(StartupRefused, match=r"blocks are \(8, 8\), the target's hidden size"):
        load_engine(ShardSettings(model_path=target, speculate=2, speculator_model=wrong))
    missing = write_heads(tmp_path / "missing", False)
    (missing / "config.json").write_text(json.dumps({"medusa_num_heads": HEADS + 1}))
    with pytest.raises(StartupRefused, match=f"no tensor {HEADS}.0.linear.weight"):
        load_engine(ShardSettings(model_path=target, speculate=2, speculator_model=missing))


def test_two_ranks_draft_like_one(
    tiny_model: Callable[..., Path], tmp_path: Path, engines: dict[str, Engine]
) -> None:
    """The target sharded over two gloo ranks, the heads replicated, the LM head they end in
    tensor-parallel: every rank serves the one-rank plain engine's tokens."""
    target = tiny_model("llama", sharded=True)
    heads = write_heads(tmp_path / "heads", False)
    mp.spawn(serve_on_rank, args=(_free_port(), target, heads, tmp_path, True), nprocs=2,
             join=True)
    assert_ranks_served(engines["plain"], tmp_path, heads, sampling=True)
