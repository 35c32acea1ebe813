"""Every kind of row drafts on the tiny Llama (--speculate, n-gram drafts) and is served the tokens
it gets without drafts: seeded sampling rows (with warpers, several seeds on one prompt as
best_of / n > 1 send them), penalised and watermarked rows, grammar-constrained rows (greedy and
sampled), with their logprobs, top tokens and finish for every emitted token."""

from __future__ import annotations

import pytest
import torch

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine import drafting
from pytgi_shard.engine.engine import Engine
from tests.unit.shard.engine.test_engine import Run
from tests.unit.shard.engine.test_speculation import greedy, pair, serve
from tests.unit.shard.router_steps import prompt_of

__all__ = ["pair"]  # the fixture, shared with test_speculation.py

Params = pb.NextTokenChooserParameters
QUOTED = prompt_of(12, 0) * 2


@pytest.fixture(autouse=True)
def greedy_back_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling rows back off as greedy rows do here: these short runs check kept drafts'
    tokens, and a sampling row's own back-off (a long pause at its first miss,
    test_draft_gate.py) would leave some of them without any."""
    monkeypatch.setattr(drafting, "SAMPLING_BACK_OFF", drafting.GREEDY_BACK_OFF)


def kept(run: Run, rid: int) -> int:
    """Drafts a request kept: the tokens its steps emitted beyond one each."""
    return sum(len(g.tokens.ids) - 1 for g in run.generations[rid])


def assert_same(got: Run, expected: Run) -> None:
    assert got.tokens == expected.tokens
    for rid in expected.tokens:
        torch.testing.assert_close(got.logprobs[rid], expected.logprobs[rid], rtol=1e-4,
                                   atol=1e-4)
        assert got.finals[rid].text == expected.finals[rid].text
        assert got.finals[rid].finish_reason == expected.finals[rid].finish_reason
        assert got.finals[rid].seed == expected.finals[rid].seed
        tops = [[(list(t.ids), list(t.logprobs)) for g in run.generations[rid]
                 for t in g.top_tokens] for run in (got, expected)]
        assert [ids for ids, _ in tops[0]] == [ids for ids, _ in tops[1]]
        for (_, a), (_, b) in zip(tops[0], tops[1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_sampling_and_penalised_rows_draft_and_keep_their_tokens(
    pair: tuple[Engine, Engine],
) -> None:
    plain, speculating = pair
    rows = {
        # The random model's distributions are wide: cooled, so that drafts are kept.
        0: Params(do_sample=True, seed=11, temperature=0.15),
        # best_of / n > 1: the same prompt under other seeds, one with top tokens.
        1: Params(do_sample=True, seed=12, temperature=0.15),
        2: Params(do_sample=True, seed=13, temperature=0.15),
        3: Params(do_sample=True, seed=14, temperature=0.2, top_k=30, top_p=0.9),
        4: Params(do_sample=True, seed=15, temperature=0.2, typical_p=0.9),
        5: Params(repetition_penalty=1.1),
        6: Params(frequency_penalty=0.3),
        7: Params(watermark=True),
    }
    reqs = [greedy(rid, QUOTED, 20, parameters=p, top_n_tokens=3 if rid == 2 else 0)
            for rid, p in rows.items()]
    expected, _ = serve(plain, reqs)
    got, _ = serve(speculating, reqs)
    assert_same(got, expected)
    assert len({tuple(got.tokens[rid]) for rid in (0, 1, 2)}) == 3
    assert all(len(got.generations[2][i].top_tokens) == len(got.generations[2][i].tokens.ids)
               for i in range(len(got.generations[2])))
    kinds = {"sampled": [0, 1, 2], "top-k, top-p": [3], "typical-p": [4], "repetition": [5],
             "frequency": [6], "watermark": [7]}
    for kind, members in kinds.items():
        assert any(kept(got, rid) for rid in members), f"{kind} rows kept no draft"


REGEX = "(ab|cd|[a-z ]){4,40}"


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_grammar_rows_draft_and_keep_their_tokens(
    pair: tuple[Engine, Engine], sampled: bool
) -> None:
    plain, speculating = pair
    params = [
        Params(grammar=REGEX, grammar_type=pb.GRAMMAR_TYPE_REGEX, do_sample=sampled, seed=rid,
               temperature=0.6 if sampled else 1.0)
        for rid in range(3)
    ]
    reqs = [greedy(rid, prompt_of(10, rid) * 2, 30, parameters=p, top_n_tokens=rid)
            for rid, p in enumerate(params)]
    # The grammar's EOS ends two of them (inside a kept run or not); one goes on past it.
    for r in reqs[1:]:
        r.stopping_parameters.ignore_eos_token = False
    # A free row beside them keeps drafting unconstrained.
    reqs.append(greedy(3, QUOTED, 20))
    expected, _ = serve(plain, reqs)
    got, _ = serve(speculating, reqs)
    assert_same(got, expected)
    assert sum(kept(got, rid) for rid in range(3)) > 0


def test_a_resumed_seeded_request_continues_its_tokens_with_drafts(
    pair: tuple[Engine, Engine],
) -> None:
    """Preemption: a seeded sampling request resumed with its first 9 tokens (prompt and those
    in chunks) draws its later tokens at their own indexes, drafting or not."""
    plain, speculating = pair
    params = Params(do_sample=True, seed=12, temperature=0.15)
    whole, _ = serve(plain, [greedy(0, QUOTED, 24, parameters=params)])
    tokens = whole.tokens[0]
    resumed = greedy(1, QUOTED, 24, parameters=params, generated_ids=tokens[:9])
    for engine in (plain, speculating):
        run, _ = serve(engine, [resumed], chunk=7)
        assert run.tokens[1] == tokens[9:]
        assert run.finals[1].seed == 12
    assert kept(run, 1) > 0
