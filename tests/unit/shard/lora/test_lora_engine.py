"""LoRA on the tiny Llama, end to end through the Engine: a request under an adapter gives the
greedy tokens and logprobs transformers gives on the base model with that adapter merged
(W + scale·B·A); one batch mixing two adapters and the base model gives each request its solo
output (prefill, a newcomer's prefill beside running decode rows, decode)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.engine import Engine
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import ShardSettings
from tests.hf_reference import hf_greedy
from tests.lora_adapters import merged_model, write_adapter
from tests.unit.shard.engine.test_batch import batch_of, request
from tests.unit.shard.engine.test_engine import Run, solo

PROMPTS = ([12, 40, 77, 9, 150, 33, 21], [5, 98, 61, 200, 14], [44, 17, 120, 63, 8, 91, 30, 11])
NEW = 8


@pytest.fixture(scope="module")
def adapters(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, Path]:
    """alpha: every projection, r=8, alpha 16; beta: q/v/o/down, r=4, rsLoRA."""
    root = tmp_path_factory.mktemp("lora")
    base = tiny_model("llama")
    return {
        "alpha": write_adapter(root / "alpha", base, rank=8, alpha=16, seed=1),
        "beta": write_adapter(root / "beta", base, rank=4, alpha=8, rslora=True, seed=2,
                              modules=("q_proj", "v_proj", "o_proj", "down_proj")),
    }


@pytest.fixture(scope="module")
def engine(tiny_model: Callable[..., Path], adapters: dict[str, Path]) -> Iterator[Engine]:
    spec = ",".join(f"{name}={path}" for name, path in adapters.items())
    engine = load_engine(ShardSettings(model_path=tiny_model("llama"), block_size=4,
                                       lora_adapters=spec))
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=128, max_batch_total_tokens=2048))
    yield engine


def lora_request(rid: int, prompt: list[int], adapter: int) -> pb.Request:
    return request(rid, prompt, max_new=NEW, ignore_eos=True, adapter_index=adapter)


def test_info_lists_the_adapters_in_wire_order(engine: Engine) -> None:
    assert list(engine.info().lora_adapters) == ["alpha", "beta"]


@pytest.mark.parametrize(("name", "index"), [("alpha", 1), ("beta", 2)])
def test_an_adapter_matches_transformers_on_the_merged_model(
    engine: Engine, tiny_model: Callable[..., Path], adapters: dict[str, Path],
    tmp_path: Path, name: str, index: int,
) -> None:
    merged = merged_model(tmp_path / "merged", tiny_model("llama"), adapters[name])
    expected, expected_lps = hf_greedy(merged, PROMPTS[0], NEW, ignore_eos=True)
    base, _ = hf_greedy(tiny_model("llama"), PROMPTS[0], NEW, ignore_eos=True)
    assert expected != base  # the adapter changes the answer: the test can fail
    run = solo(engine, lora_request(1, PROMPTS[0], index))
    assert run.tokens[1] == expected
    torch.testing.assert_close(run.logprobs[1], expected_lps, rtol=1e-3, atol=1e-3)


def test_a_mixed_batch_gives_each_request_its_solo_output(engine: Engine) -> None:
    """Rows of alpha, beta and the base model in one prefill, then a newcomer under alpha
    prefilled beside their decode rows, then decode to the end."""
    reqs = [lora_request(10 + i, p, i) for i, p in enumerate(PROMPTS)]
    late = lora_request(20, PROMPTS[1], 1)
    alone = {r.id: solo(engine, r) for r in [*reqs, late]}
    run = Run(engine)
    cached = run.prefill(batch_of(*reqs, batch_id=1))
    assert cached is not None
    cached = run.decode(cached)
    assert cached is not None
    run.finish(run.prefill(batch_of(late, batch_id=2), cached))
    for rid, one in alone.items():
        assert run.tokens[rid] == one.tokens[rid], rid
        torch.testing.assert_close(run.logprobs[rid], one.logprobs[rid], rtol=1e-4, atol=1e-4)
    assert len({tuple(alone[r.id].tokens[r.id]) for r in reqs}) == 3


def test_an_adapter_index_beyond_the_loaded_ones_is_refused(engine: Engine) -> None:
    with pytest.raises(InvalidRequest, match="adapter_index 3"):
        engine.prefill(pb.PrefillRequest(batch=batch_of(lora_request(30, PROMPTS[0], 3))))


def test_drafts_and_look_aheads_run_under_each_rows_adapter(
    engine: Engine, tiny_model: Callable[..., Path], adapters: dict[str, Path]
) -> None:
    """--speculate (verification forwards) and the overlap scheduler (look-ahead forwards) give
    the tokens of the plain engine, row by row under its adapter; kept drafts prove the
    verification path ran."""
    spec = ",".join(f"{name}={path}" for name, path in adapters.items())
    drafting = load_engine(ShardSettings(model_path=tiny_model("llama"), block_size=4,
                                         lora_adapters=spec, speculate=3, overlap=True))
    drafting.warmup(pb.WarmupRequest(max_prefill_tokens=128, max_batch_total_tokens=2048))
    drafting.drafting_batch = 64
    repeating = [12, 40, 77, 9] * 4
    reqs = [request(40 + i, repeating, max_new=12, ignore_eos=True, adapter_index=i,
                    blocks=list(range(1 + 10 * i, 11 + 10 * i))) for i in range(3)]
    run = Run(drafting)
    run.finish(run.prefill(batch_of(*reqs, batch_id=7)))
    for r in reqs:
        assert run.tokens[r.id] == solo(engine, r).tokens[r.id], r.adapter_index
    assert any(len(g.tokens.ids) > 1 for gens in run.generations.values() for g in gens)
