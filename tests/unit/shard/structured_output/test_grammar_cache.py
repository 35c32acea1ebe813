"""The shard's grammar cache holds at most its byte budget: grammars' sources and the matchers
prepared for requests about to run, evicted least recently used first (a prepared matcher by
its age), a taken matcher leaving it; only the newest entry may stand over the budget. Its
estimate of a matcher grows with the grammar, so a few huge grammars cannot fill memory where
a count of entries would have let them."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.structured_output.cache import GrammarCache, Prepared, matcher_bytes
from pytgi_shard.structured_output.compiler import GrammarCompiler, GrammarSpec
from pytgi_shard.structured_output.worker import MaskWorker
from tests.tiny_models import _CORPUS, train_tokenizer


def prepared(tag: int) -> Prepared:
    """A stand-in matcher: the cache never looks inside one."""
    return Prepared(matcher=None, words=np.full(4, tag, dtype=np.int32))  # type: ignore[arg-type]


def test_sources_and_prepared_matchers_share_the_budget_least_recently_used_first() -> None:
    cache: GrammarCache[str] = GrammarCache(budget_bytes=100)
    cache.add_source("a", "x" * 30)
    cache.add_prepared("a", prepared(1), 30)
    cache.add_source("b", "y" * 30)
    assert cache.bytes == 90 and len(cache) == 2
    assert cache.source("a") == "x" * 30  # a use: "a" is now the most recent
    cache.add_prepared("b", prepared(2), 30)  # 120 > 100: the oldest, a's matcher, goes
    assert cache.bytes == 90
    assert cache.prepared_count("a") == 0 and cache.prepared_count("b") == 1
    cache.add_source("c", "z" * 30)  # then b's source, the least recently used
    assert cache.source("b") is None and cache.source("a") is not None
    assert cache.bytes == 90 <= cache.budget_bytes


def test_a_taken_matcher_leaves_the_cache_oldest_first() -> None:
    cache: GrammarCache[str] = GrammarCache(budget_bytes=1000)
    for tag in (1, 2):
        cache.add_prepared("a", prepared(tag), 100)
    first, second = cache.take("a"), cache.take("a")
    assert first is not None and second is not None
    assert (int(first.words[0]), int(second.words[0])) == (1, 2)
    assert cache.take("a") is None and cache.bytes == 0


def test_only_the_newest_entry_may_exceed_the_budget() -> None:
    cache: GrammarCache[str] = GrammarCache(budget_bytes=100)
    cache.add_source("small", "s")
    cache.add_prepared("huge", prepared(1), 500)
    assert cache.bytes == 500 and cache.source("small") is None
    assert cache.take("huge") is not None
    cache.add_prepared("other", prepared(2), 10)
    assert cache.bytes == 10


def test_a_matchers_estimate_grows_with_its_grammar() -> None:
    """~58 MB measured for the 10,000-property schema's matcher, ~0.2 MB for a small one."""
    small, big = "x" * 1_000, "x" * 270_000
    assert matcher_bytes(small, 4008) < 1 << 20
    assert 40 << 20 < matcher_bytes(big, 4008) < 100 << 20


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    tokenizer: Tokenizer = train_tokenizer(_CORPUS)
    return tokenizer.to_str()


def test_the_compilers_cache_stays_within_its_budget(tokenizer_json: str) -> None:
    """Distinct grammars prepared one after another: the old cache kept the last 256 whatever
    their size; the budget holds what fits."""
    budget = 3 * matcher_bytes("x" * 500, (400 + 31) // 32)
    compiler = GrammarCompiler(tokenizer_json, 400, [1], MaskWorker(), cache_bytes=budget)
    try:
        assert compiler.mask_width == (400 + 31) // 32
        for i in range(12):
            schema = {"type": "object", "properties": {f"p{i}_{j}": {"type": "integer"}
                                                        for j in range(8)}}  # fmt: skip
            spec = GrammarSpec(pb.GRAMMAR_TYPE_JSON, json.dumps(schema))
            assert compiler.prepare(spec).result(timeout=60) is False
            assert compiler.cache.bytes <= budget
        assert 0 < len(compiler) < 12
        assert compiler.stats.prepared == 12
    finally:
        compiler.worker.shutdown()
