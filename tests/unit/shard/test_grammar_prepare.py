"""PrepareGrammar: grammars compiled off the step, in the compile pool, before their requests
are scheduled. A prepared grammar is a cache hit when its request's Prefill arrives (nothing is
compiled on the step); a grammar asked for while it compiles is compiled once; a refused one
fails its future with llguidance's message; an engine's prepare answers whether it was cached."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.grammar import GrammarCompiler, GrammarSpec
from pytgi_shard.grammar_worker import MaskWorker
from tests.tiny_models import _CORPUS, train_tokenizer
from tests.unit.shard.router_steps import build_engine
from tests.unit.shard.test_batch import request
from tests.unit.shard.test_engine import Run


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tokenizer: Tokenizer = train_tokenizer(_CORPUS)
    return GrammarCompiler(tokenizer.to_str(), 400, [1], MaskWorker())


def test_a_grammar_asked_for_while_it_compiles_is_compiled_once(compiler: GrammarCompiler) -> None:
    spec = GrammarSpec(pb.GRAMMAR_TYPE_REGEX, "(once)+")
    before = (compiler.stats.hits, compiler.stats.misses)
    gate = threading.Event()
    compiler.worker.compile_pool.submit(gate.wait)  # holds the pool: the compile stays queued
    first = compiler.prepare(spec)
    second = compiler.prepare(spec)
    assert second is first and not first.done()
    gate.set()
    # The step's compile waits for the compilation under way rather than compiling again.
    assert compiler.compile(spec) is first.result(timeout=10)
    assert compiler.prepare(spec).done()
    after = (compiler.stats.hits, compiler.stats.misses)
    assert after == (before[0] + 1, before[1] + 1)


def test_a_refused_grammar_fails_its_future_and_is_not_cached(compiler: GrammarCompiler) -> None:
    spec = GrammarSpec(pb.GRAMMAR_TYPE_REGEX, "(ab")
    for _ in range(2):
        with pytest.raises(InvalidRequest, match="(?s)invalid grammar: .*unclosed group"):
            compiler.prepare(spec).result(timeout=10)
    assert spec not in compiler._cache and spec not in compiler._compiling


def test_a_prepared_grammar_compiles_nothing_on_the_step(tiny_model: Callable[..., Path]) -> None:
    engine = build_engine(tiny_model("llama"), False)
    schema = json.dumps({"type": "object", "properties": {"prepared": {"type": "boolean"}}})
    prepare = pb.PrepareGrammarRequest(grammar_type=pb.GRAMMAR_TYPE_JSON, grammar=schema)
    assert engine.prepare_grammar(prepare).result(timeout=30) is False
    assert engine.prepare_grammar(prepare).result(timeout=30) is True
    stats = engine.grammars.stats
    misses = stats.misses
    params = pb.NextTokenChooserParameters(grammar=schema, grammar_type=pb.GRAMMAR_TYPE_JSON)
    run = Run(engine)
    batch = pb.Batch(id=1, requests=[request(1, [5, 6], max_new=6, parameters=params)], size=1)
    run.finish(run.prefill(batch))
    assert 1 in run.finals
    assert stats.misses == misses
    with pytest.raises(InvalidRequest, match="invalid grammar: Invalid type: strin"):
        engine.prepare_grammar(
            pb.PrepareGrammarRequest(grammar_type=pb.GRAMMAR_TYPE_JSON, grammar='{"type": "strin"}')
        ).result(timeout=30)
    with pytest.raises(InvalidRequest, match="needs a grammar"):
        engine.prepare_grammar(pb.PrepareGrammarRequest())
