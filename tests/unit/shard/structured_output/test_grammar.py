"""Constrained requests on a tiny random model: it knows nothing, so every valid output is the
grammar's doing. Outputs that end by EOS validate against their JSON schema or fullmatch their
regex; free requests in the same batch get exactly the tokens they get alone; the grammar state
survives concatenation, filtering, the overlap scheduler, chunked prefill and a resume."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.engine import Engine
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.output.stopping import EOS_TOKEN, LENGTH
from tests.unit.shard.engine.test_batch import request
from tests.unit.shard.engine.test_engine import Run
from tests.unit.shard.router_steps import Engines, Router, prompt_of

SAMPLES = 6

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested objects": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 99},
                    "tags": {"type": "object", "properties": {"x": {"type": "boolean"}},
                             "required": ["x"], "additionalProperties": False},
                },
                "required": ["id", "tags"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "enum": {"enum": ["red", "green", "blue", 7, None]},
    "array bounds": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3},
    "string length bounds": {"type": "string", "minLength": 2, "maxLength": 4},
    "anyOf": {"anyOf": [{"type": "boolean"}, {"type": "string", "maxLength": 3},
                        {"type": "object", "properties": {"n": {"type": "null"}},
                         "required": ["n"], "additionalProperties": False}]},
    "additionalProperties false": {
        "type": "object",
        "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "y"]}},
        "required": ["b"],
        "additionalProperties": False,
    },
}
REGEXES = ["[0-9]{3}-[a-z]{2,4}", "(yes|no|maybe)!?", "[A-Z][a-z]{1,5}( [A-Z][a-z]{1,5})?"]




def json_params(schema: dict[str, Any], seed: int, **kw: Any) -> pb.NextTokenChooserParameters:
    return pb.NextTokenChooserParameters(
        do_sample=True, seed=seed, grammar=json.dumps(schema),
        grammar_type=pb.GRAMMAR_TYPE_JSON, **kw,
    )  # fmt: skip


def regex_params(regex: str, seed: int) -> pb.NextTokenChooserParameters:
    return pb.NextTokenChooserParameters(
        do_sample=True, seed=seed, grammar=regex, grammar_type=pb.GRAMMAR_TYPE_REGEX
    )


def constrained(rid: int, params: pb.NextTokenChooserParameters, max_new: int = 64) -> pb.Request:
    return request(rid, prompt_of(5, rid), max_new=max_new, parameters=params)


def run_batch(engine: Engine, requests: list[pb.Request]) -> Run:
    run = Run(engine)
    run.finish(run.prefill(pb.Batch(id=1, requests=requests, size=len(requests))))
    return run


def ended_texts(run: Run) -> list[str]:
    """The texts of the requests that ended by the grammar (EOS); most must have."""
    ended = [f.text for f in run.finals.values() if f.finish_reason == EOS_TOKEN]
    assert len(ended) * 2 >= len(run.finals), [f.text for f in run.finals.values()]
    return ended


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_sampled_outputs_validate_against_their_schema(engines: Engines, name: str) -> None:
    schema = SCHEMAS[name]
    run = run_batch(engines(False), [constrained(i, json_params(schema, i)) for i in range(SAMPLES)])
    for text in ended_texts(run):
        jsonschema.validate(json.loads(text), schema)


def test_sampled_outputs_fullmatch_their_regex(engines: Engines) -> None:
    requests = [
        constrained(i, regex_params(regex, seed=i), max_new=32)
        for i, regex in enumerate(REGEXES * 2)
    ]
    run = run_batch(engines(False), requests)
    for rid, final in run.finals.items():
        assert final.finish_reason == EOS_TOKEN
        assert re.fullmatch(REGEXES[rid % len(REGEXES)], final.text), final.text


LARK = ('start: "<think>" /[a-z]{1,8}/ "</think>" answer\n'
        'answer: %json {"type": "object", "properties": {"n": {"type": "integer"}}, '
        '"required": ["n"], "additionalProperties": false, '
        '"x-guidance": {"whitespace_pattern": "[ ]?"}}')
LARK_OUTPUT = re.compile(r'<think>[a-z]{1,8}</think>(\{.*\})', re.S)


def test_sampled_outputs_follow_their_lark_grammar(engines: Engines) -> None:
    """GRAMMAR_TYPE_LARK (what the router sends for a reasoning model's constrained answer):
    text before an embedded JSON Schema."""
    params = [pb.NextTokenChooserParameters(do_sample=True, seed=i, grammar=LARK,
                                            grammar_type=pb.GRAMMAR_TYPE_LARK) for i in range(3)]
    run = run_batch(engines(False), [constrained(i, p, max_new=48) for i, p in enumerate(params)])
    for text in ended_texts(run):
        m = LARK_OUTPUT.fullmatch(text)
        assert m is not None, text
        assert isinstance(json.loads(m.group(1))["n"], int)


def test_a_complete_grammar_allows_only_eos_and_ends_the_request(engines: Engines) -> None:
    """Three digits and nothing else may follow: EOS is forced (greedy, penalties on) and the
    request ends by it, as TGI; penalties and temperature never re-allow a banned token."""
    params = pb.NextTokenChooserParameters(
        grammar="[0-9]{3}", grammar_type=pb.GRAMMAR_TYPE_REGEX, repetition_penalty=5.0,
        temperature=0.3, frequency_penalty=1.0, top_k=3,
    )  # fmt: skip
    run = run_batch(engines(False), [constrained(1, params, max_new=20)])
    final = run.finals[1]
    assert re.fullmatch("[0-9]{3}", final.text)
    assert (final.finish_reason, final.generated_tokens) == (EOS_TOKEN, len(run.tokens[1]))
    assert run.tokens[1][-1] in engines(False).detokenizer.eos_ids


def test_free_requests_in_a_mixed_batch_get_the_tokens_they_get_alone(engines: Engines) -> None:
    engine = engines(False)
    free = [
        request(10, prompt_of(6, 1), max_new=12, ignore_eos=True),
        request(11, prompt_of(4, 2), max_new=12, ignore_eos=True,
                parameters=pb.NextTokenChooserParameters(do_sample=True, seed=3, top_p=0.9)),
    ]  # fmt: skip
    alone = run_batch(engine, free)
    schema = SCHEMAS["additionalProperties false"]
    mixed = run_batch(engine, [free[0], constrained(1, json_params(schema, 1)), free[1]])
    for rid in (10, 11):
        assert mixed.tokens[rid] == alone.tokens[rid]
    jsonschema.validate(json.loads(mixed.finals[1].text), schema)


def script(engine: Engine) -> Run:
    """A router's calls: a constrained batch, a Prefill joining it (JSON and a free request), a
    FilterBatch dropping one constrained request mid-way, decodes to the end."""
    run = Run(engine)
    first = [
        constrained(1, json_params(SCHEMAS["nested objects"], 1)),
        constrained(2, regex_params(REGEXES[2], 2), max_new=24),
        constrained(3, json_params(SCHEMAS["array bounds"], 3)),
    ]
    cached = run.prefill(pb.Batch(id=1, requests=first, size=3))
    cached = run.decode(cached) if cached else None
    joining = [
        request(4, prompt_of(3, 4), max_new=6, ignore_eos=True),
        constrained(5, json_params(SCHEMAS["anyOf"], 5)),
    ]
    cached = run.prefill(pb.Batch(id=2, requests=joining, size=2), cached)
    for _ in range(2):
        cached = run.decode(cached) if cached else None
    if cached is not None:
        keep = [i for i in cached.request_ids if i != 3]
        kept = engine.filter(cached.id, keep)
        run.finish(kept)
    return run


# (overlap, grammar_thread): the CPU's default (grammar inline), an accelerator's (overlap and
# the grammar thread), and the grammar thread without overlap.
@pytest.mark.parametrize(("overlap", "thread"), [(False, None), (True, True), (False, True)])
def test_grammar_state_survives_concatenate_filter_and_overlap(
    engines: Engines, overlap: bool, thread: bool | None
) -> None:
    engine = engines(overlap, grammar_thread=thread)
    assert engine.grammars.worker.inline is (thread is None)
    run = script(engine)
    reference = script(engines(False))
    assert run.tokens == reference.tokens
    for rid, schema in ((1, SCHEMAS["nested objects"]), (5, SCHEMAS["anyOf"])):
        final = run.finals[rid]
        if final.finish_reason == EOS_TOKEN:
            jsonschema.validate(json.loads(final.text), schema)
    if run.finals[2].finish_reason == EOS_TOKEN:
        assert re.fullmatch(REGEXES[2], run.finals[2].text)
    # Each request alone gets the same tokens (its grammar state followed it between batches).
    for rid, r in ((1, 1), (5, 5)):
        schema = SCHEMAS["nested objects"] if rid == 1 else SCHEMAS["anyOf"]
        alone = run_batch(engines(False), [constrained(rid, json_params(schema, r))])
        assert alone.tokens[rid] == run.tokens[rid]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_resumed_or_chunked_request_continues_its_grammar(engines: Engines, overlap: bool) -> None:
    schema = SCHEMAS["nested objects"]
    r = constrained(1, json_params(schema, 7))
    whole = run_batch(engines(False), [r]).tokens[1]
    assert len(whole) > 6
    engine = engines(overlap)
    again = pb.Request()
    again.CopyFrom(r)
    again.generated_ids[:] = whole[:5]
    router = Router(engine, next_block=40)
    total = len(r.input_ids) + 5
    router.prefill(1, [router.chunk(again, 0, 4)])
    router.prefill(2, [router.chunk(again, 4, total - 4)])
    router.finish()
    assert router.run.tokens[1] == whole[5:]


def test_each_request_gets_a_matcher_of_its_own_and_the_grammar_is_converted_once(
    engines: Engines,
) -> None:
    """Requests sent straight to the engine (no PrepareGrammar) have their matcher built on the
    step, one each; the grammar's source is kept once."""
    engine = engines(False)
    schema = {"type": "object", "properties": {"only-here": {"type": "boolean"}}}
    known, misses = len(engine.grammars), engine.grammars.stats.misses
    run_batch(engine, [constrained(1, json_params(schema, 1), max_new=4)])
    run_batch(engine, [constrained(2, json_params(schema, 2), max_new=4)])
    assert len(engine.grammars) == known + 1
    assert engine.grammars.stats.misses == misses + 2


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (pb.NextTokenChooserParameters(grammar="(ab", grammar_type=pb.GRAMMAR_TYPE_REGEX),
         "(?s)invalid grammar: .*unclosed group"),
        (pb.NextTokenChooserParameters(grammar='{"type": "strin"}',
                                       grammar_type=pb.GRAMMAR_TYPE_JSON),
         "invalid grammar: Invalid type: strin"),
        (pb.NextTokenChooserParameters(grammar="{not json", grammar_type=pb.GRAMMAR_TYPE_JSON),
         "not valid JSON"),
        (pb.NextTokenChooserParameters(grammar="[a-z]"), "grammar_type is GRAMMAR_TYPE_NONE"),
        (pb.NextTokenChooserParameters(grammar_type=pb.GRAMMAR_TYPE_REGEX), "needs a grammar"),
        (pb.NextTokenChooserParameters(grammar="x", grammar_type=7), "unknown grammar_type 7"),
    ],
)  # fmt: skip
def test_an_invalid_grammar_is_refused_and_the_running_batch_goes_on(
    engines: Engines, params: pb.NextTokenChooserParameters, message: str
) -> None:
    engine = engines(False)
    run = Run(engine)
    cached = run.prefill(pb.Batch(id=1, requests=[request(1, [5, 6], max_new=4)], size=1))
    assert cached is not None
    bad = pb.PrefillRequest(batch=pb.Batch(id=2, requests=[request(2, [5], parameters=params)]))
    bad.cached_batch.CopyFrom(cached)
    with pytest.raises(InvalidRequest, match=message):
        engine.prefill(bad)
    run.finish(run.decode(cached))
    assert run.finals[1].finish_reason in (EOS_TOKEN, LENGTH)
