"""PrepareGrammar: each constrained request's own matcher built off the step, in the compile
pool, with its first mask computed, before the request is scheduled; its first step takes it
and computes nothing. No two requests share a matcher's state: one whose matcher failed leaves
the grammar working for the next. A refused grammar (invalid, or allowing no output) fails the
future with llguidance's reason and is not cached."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.structured_output.batch_grammar import BatchGrammar
from pytgi_shard.structured_output.compiler import GrammarCompiler, GrammarSpec
from pytgi_shard.structured_output.worker import MaskWorker
from tests.tiny_models import _CORPUS, train_tokenizer
from tests.unit.shard.engine.test_batch import request
from tests.unit.shard.engine.test_engine import Run
from tests.unit.shard.router_steps import build_engine

EOS = 1
# A string pattern whose lexer llguidance cannot build past a few dozen bytes of output:
# "too many expressions constructed".
HOSTILE = {"type": "object", "required": ["a"],
           "properties": {"a": {"type": "string", "pattern": r"^(\w{0,1000}\d{0,1000}){0,1000}$"}}}  # fmt: skip


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tokenizer: Tokenizer = train_tokenizer(_CORPUS)
    return GrammarCompiler(tokenizer.to_str(), 400, [EOS], MaskWorker())


def allowed(words: np.ndarray) -> list[int]:
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:400]
    return [int(t) for t in np.flatnonzero(bits)]


def test_each_prepare_builds_one_matcher_that_its_step_takes(compiler: GrammarCompiler) -> None:
    spec = GrammarSpec(pb.GRAMMAR_TYPE_REGEX, "(once)+")
    stats = compiler.stats
    before = (stats.prepared, stats.hits, stats.misses)
    gate = threading.Event()
    compiler.worker.compile_pool.submit(gate.wait)  # holds the pool: the builds stay queued
    first, second = compiler.prepare(spec), compiler.prepare(spec)
    assert not first.done()
    gate.set()
    assert (first.result(timeout=10), second.result(timeout=10)) == (False, True)
    one, two = compiler.take(spec), compiler.take(spec)
    assert one.matcher is not two.matcher
    assert allowed(one.words) == allowed(two.words) != [EOS]
    compiler.take(spec)  # nothing prepared: built now
    after = (stats.prepared, stats.hits, stats.misses)
    assert after == (before[0] + 2, before[1] + 2, before[2] + 1)


def test_a_requests_first_mask_is_computed_with_its_matcher_not_on_the_step(
    compiler: GrammarCompiler,
) -> None:
    spec = GrammarSpec(pb.GRAMMAR_TYPE_REGEX, "[0-9]{2}x")
    compiler.prepare(spec).result(timeout=10)
    worker = compiler.worker
    calls: list[int] = []
    fill = worker.fill_masks
    worker.fill_masks = lambda matchers, words: calls.append(len(matchers))  # type: ignore[method-assign]
    try:
        grammar = BatchGrammar.start([spec], [[]], [True], compiler, torch.device("cpu"))
        assert grammar is not None
        _, bias = grammar.banned()
    finally:
        worker.fill_masks = fill  # type: ignore[method-assign]
    assert calls == []
    assert isinstance(bias, torch.Tensor)
    digits = {t for t in range(400) if bias[0, t] == 0}
    assert digits and EOS not in digits


def test_a_failed_matcher_leaves_the_grammar_working_for_the_next_request(
    compiler: GrammarCompiler,
) -> None:
    """The matchers used to be deep copies of one cached matcher, sharing its lexer: once one
    request's output blew the lexer up, every later request of the grammar started in the
    error state, its mask EOS alone (one empty token), until the shard restarted."""
    spec = GrammarSpec(pb.GRAMMAR_TYPE_JSON, json.dumps(HOSTILE))
    compiler.prepare(spec).result(timeout=10)
    first = compiler.take(spec)
    rng = np.random.default_rng(0)
    words = first.words
    for _ in range(200):
        choices = [t for t in allowed(words) if t != EOS]
        first.matcher.consume_token(int(rng.choice(choices)))
        first.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if first.matcher.is_error():
            break
    assert "too many expressions" in first.matcher.get_error()
    compiler.prepare(spec).result(timeout=10)
    for following in (compiler.take(spec), compiler.take(spec)):
        assert not following.matcher.is_error()
        token = next(t for t in allowed(following.words) if t != EOS)
        assert following.matcher.consume_token(token)


@pytest.mark.parametrize(("grammar_type", "text", "reason"), [
    (pb.GRAMMAR_TYPE_REGEX, "(ab", "(?s)invalid grammar: .*unclosed group"),
    (pb.GRAMMAR_TYPE_REGEX, "[a&&b]", "invalid grammar: no output can match it"),
    (pb.GRAMMAR_TYPE_REGEX, r"[^\x00-\x{10FFFF}]", "invalid grammar: no output can match it"),
    (pb.GRAMMAR_TYPE_JSON, '{"$ref": "#"}', "invalid grammar: no output can match it"),
])  # fmt: skip
def test_a_refused_grammar_fails_its_future_and_is_not_cached(
    compiler: GrammarCompiler, grammar_type: int, text: str, reason: str
) -> None:
    spec = GrammarSpec(grammar_type, text)
    for _ in range(2):
        with pytest.raises(InvalidRequest, match=reason):
            compiler.prepare(spec).result(timeout=10)
    assert compiler.cache.source(spec) is None and compiler.cache.prepared_count(spec) == 0


def test_a_prepared_grammar_builds_nothing_on_the_step(tiny_model: Callable[..., Path]) -> None:
    engine = build_engine(tiny_model("llama"), False)
    schema = json.dumps({"type": "object", "properties": {"prepared": {"type": "boolean"}}})
    prepare = pb.PrepareGrammarRequest(grammar_type=pb.GRAMMAR_TYPE_JSON, grammar=schema)
    assert engine.prepare_grammar(prepare).result(timeout=30) is False
    stats = engine.grammars.stats
    misses, hits = stats.misses, stats.hits
    params = pb.NextTokenChooserParameters(grammar=schema, grammar_type=pb.GRAMMAR_TYPE_JSON)
    run = Run(engine)
    batch = pb.Batch(id=1, requests=[request(1, [5, 6], max_new=6, parameters=params)], size=1)
    run.finish(run.prefill(batch))
    assert 1 in run.finals
    assert (stats.misses, stats.hits) == (misses, hits + 1)
    assert engine.prepare_grammar(prepare).result(timeout=30) is True
    with pytest.raises(InvalidRequest, match="invalid grammar: Invalid type: strin"):
        engine.prepare_grammar(
            pb.PrepareGrammarRequest(grammar_type=pb.GRAMMAR_TYPE_JSON, grammar='{"type": "strin"}')
        ).result(timeout=30)
    with pytest.raises(InvalidRequest, match="needs a grammar"):
        engine.prepare_grammar(pb.PrepareGrammarRequest())
