"""A matcher that fails while its request runs (a limit hit, a refused token) fails that request
alone: its Generation carries the error, it leaves the shard's batch, and the other requests go
on. It used to be turned into EOS (the error state's mask allows nothing else): the request
ended "eos_token" with output its grammar does not match."""

from __future__ import annotations

import json

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.output.stopping import EOS_TOKEN, LENGTH
from tests.unit.shard.engine.test_batch import request
from tests.unit.shard.engine.test_engine import Run
from tests.unit.shard.router_steps import Engines
from tests.unit.shard.structured_output.test_grammar import constrained, json_params, run_batch
from tests.unit.shard.structured_output.test_grammar_prepare import HOSTILE

# 600 optional properties: after `{` llguidance's parser row holds ~2,400 items, over its limit
# of 2,000 (unless the model writes `{}` at once, one token of the tiny vocabulary).
WIDE = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}


def errors(run: Run, rid: int) -> list[str]:
    return [g.error for g in run.generations.get(rid, []) if g.HasField("error")]


def test_a_replayed_token_the_grammar_refuses_fails_the_request_not_its_neighbour(
    engines: Engines,
) -> None:
    """A request resumed with tokens its grammar refuses: its first step reports the failure
    (no EOS, no final text) and it leaves the batch; the free request beside it runs on."""
    engine = engines(False)
    letter = engine.detokenizer.tokenizer.encode("x", add_special_tokens=False).ids[0]
    params = pb.NextTokenChooserParameters(grammar="[0-9]{3}", grammar_type=pb.GRAMMAR_TYPE_REGEX)
    resumed = request(1, [5, 6], max_new=8, parameters=params)
    resumed.generated_ids[:] = [letter]
    free = request(2, [7, 8], max_new=5, ignore_eos=True)
    run = Run(engine)
    cached = run.prefill(pb.Batch(id=1, requests=[resumed, free], size=2))
    assert cached is not None and list(cached.request_ids) == [2]
    assert 1 not in run.finals
    assert len(errors(run, 1)) == 1 and errors(run, 1)[0].startswith("the grammar's matcher failed")
    run.finish(cached)
    assert run.finals[2].generated_tokens == 5 and not errors(run, 2)


def test_a_grammar_over_a_parser_limit_fails_its_request_with_the_reason(engines: Engines) -> None:
    engine = engines(False)
    outcomes = []
    for seed in range(4):
        run = run_batch(engine, [constrained(1, json_params(WIDE, seed), max_new=16)])
        if 1 in run.finals:
            assert json.loads(run.finals[1].text) == {} and not errors(run, 1)
            continue
        (error,) = errors(run, 1)
        assert "Current row has" in error and "max is 2000" in error
        outcomes.append(len(run.generations[1]))
    assert outcomes and max(outcomes) <= 3  # `{`, then the failed mask's step


def test_a_request_whose_lexer_blows_up_fails_and_the_grammar_serves_the_next(
    engines: Engines,
) -> None:
    """Most seeds drive the tiny model into the pattern's lexer limit within a few dozen
    tokens. The next request of the grammar starts afresh: it used to get one token, EOS, from
    the shared lexer's error state."""
    engine = engines(False)
    failed = next(
        run for run in (
            run_batch(engine, [constrained(1, json_params(HOSTILE, seed), max_new=200)])
            for seed in range(6)
        ) if errors(run, 1)
    )  # fmt: skip
    assert 1 not in failed.finals
    assert "too many expressions constructed" in errors(failed, 1)[0]
    for rid in (2, 3):
        after = run_batch(engine, [constrained(rid, json_params(HOSTILE, rid), max_new=8)])
        assert not errors(after, rid)
        final = after.finals[rid]
        if final.finish_reason == EOS_TOKEN:
            json.loads(final.text)
        else:
            assert (final.finish_reason, final.generated_tokens) == (LENGTH, 8)
