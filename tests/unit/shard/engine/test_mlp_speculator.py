"""IBM's MLP speculator (--speculator-model with config.json's architecture
MLPSpeculatorPreTrainedModel): detected; random stages, tied and untied, give the greedy tokens
served without speculation across chunked prefill and a resumed request; stages built to
copy their input token propose each row's newest token (the token the stages start from);
misfit checkpoints are refused in one line."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pytgi_shard.engine.engine import Engine
from pytgi_shard.engine.hidden_drafter import HiddenStateDrafter
from pytgi_shard.service.startup import StartupRefused, load_engine
from pytgi_shard.settings import ShardSettings
from tests.tiny_models import VOCAB_SIZE
from tests.unit.shard.engine.speculator_cases import (
    SPECULATE,
    assert_chunked_and_resumed_served,
    assert_same,
    build,
    requests,
    serve,
    watch_newest_token_drafts,
)
from tests.unit.shard.engine.test_medusa import HIDDEN
from tests.unit.shard.engine.test_speculation import greedy
from tests.unit.shard.router_steps import prompt_of

STAGES = 3


def write_speculator(path: Path, tied: bool, copy: bool = False, seed: int = 0) -> Path:
    """An MLP speculator checkpoint. `copy`: an inner dimension of the vocabulary's size, no
    projection of the state, the identity as embedding and head, so that every stage chooses
    the token it was given (the RMS norm and GELU keep a one-hot's largest entry largest)."""
    path.mkdir(parents=True, exist_ok=True)
    inner = VOCAB_SIZE if copy else 48
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(1 if tied else STAGES):
        tensors[f"speculator.emb.{i}.weight"] = (
            torch.eye(VOCAB_SIZE) if copy else torch.randn(VOCAB_SIZE, inner, generator=g))
        tensors[f"speculator.head.{i}.weight"] = (
            torch.eye(VOCAB_SIZE) if copy else torch.randn(VOCAB_SIZE, inner, generator=g) * 0.2)
        tensors[f"speculator.ln.{i}.weight"] = torch.ones(inner)
        tensors[f"speculator.ln.{i}.bias"] = torch.zeros(inner)
    for i in range(2 if tied else STAGES):
        width = HIDDEN if i == 0 else inner
        tensors[f"speculator.proj.{i}.weight"] = (
            torch.zeros(inner, width) if copy else torch.randn(inner, width, generator=g) * 0.1)
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
        "emb_dim": HIDDEN, "inner_dim": inner, "n_predict": STAGES, "vocab_size": VOCAB_SIZE,
        "tie_weights": tied, "top_k_tokens_per_head": [1] * STAGES,
    }))
    return path


@pytest.fixture(scope="module")
def engines(
    tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Engine]]:
    target = tiny_model("llama")
    root = tmp_path_factory.mktemp("mlp")
    yield {
        "plain": build(target),
        "untied": build(target, SPECULATE, write_speculator(root / "untied", False)),
        "tied": build(target, SPECULATE, write_speculator(root / "tied", True)),
        "copy": build(target, SPECULATE, write_speculator(root / "copy", False, copy=True)),
    }


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_served_greedy_tokens_equal_those_without_speculation(
    engines: dict[str, Engine], kind: str
) -> None:
    engine = engines[kind]
    assert isinstance(engine.drafter, HiddenStateDrafter)
    assert engine.drafter.name == "mlp-speculator"
    expected = serve(engines["plain"], requests())
    got = serve(engine, requests())
    assert_same(got.run, expected.run)
    assert got.drafted > 0
    assert_chunked_and_resumed_served(engines["plain"], engine)


def test_the_stages_start_from_each_row_s_newest_token(
    engines: dict[str, Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engines["copy"]
    seen = watch_newest_token_drafts(engine, monkeypatch)
    reqs = [greedy(0, prompt_of(12, 7) * 2, 20), greedy(1, prompt_of(8, 8), 16)]
    assert_same(serve(engine, reqs, chunk=5).run, serve(engines["plain"], reqs, chunk=5).run)
    assert len(seen) >= 4 and all(seen)


def test_misfit_checkpoints_are_refused(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    target = tiny_model("llama")
    wrong = write_speculator(tmp_path / "wrong", False)
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "n_predict": STAGES + 1}))
    with pytest.raises(StartupRefused, match=f"no tensor speculator.proj.{STAGES}.weight"):
        load_engine(ShardSettings(model_path=target, speculate=2, speculator_model=wrong))
    narrow = write_speculator(tmp_path / "narrow", True)
    save_file({**{k: v for k, v in _tensors(narrow).items() if k != "speculator.proj.0.weight"},
               "speculator.proj.0.weight": torch.zeros(48, HIDDEN // 2)},
              narrow / "model.safetensors")
    with pytest.raises(StartupRefused, match=f"takes {HIDDEN // 2} features"):
        load_engine(ShardSettings(model_path=target, speculate=2, speculator_model=narrow))


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")
