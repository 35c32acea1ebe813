"""A speculating sequence's steps in the router: a Generation with several tokens (kept drafts,
then the model's token) streams one event per token, advances the sequence by all of them, and
commits to the prefix cache only blocks whose every token's KV is written (never the last
token's, whose KV the next step writes)."""

from __future__ import annotations

from pytgi_router.core.prefix_cache import PrefixCache
from pytgi_router.core.request_stream import End, Token
from pytgi_router.core.running_batch import RunningBatch
from pytgi_router.core.step_plan import Chunk, grow_running
from tests.unit.router.core.test_running_batch import cached, drain, generation, make_entry


def test_several_tokens_in_one_generation_stream_advance_and_commit() -> None:
    cache = PrefixCache(50, 4)
    running = RunningBatch(cache, lambda e: None)
    entry = make_entry(0, cache, prompt=3, new=20)
    running.start([Chunk.of(entry, 0, 3)])
    running.apply_step([generation(0, 7)], cached(0))  # the prompt's step: its first token
    assert entry.tokens == [10, 11, 12, 7] and entry.computed == 3
    grow_running(cache, [entry], speculate=4)  # room for 4 drafts: positions 3..7
    assert entry.blocks_held * cache.block_size >= 4 + 1 + 4
    # A verification step kept 3 drafts (8, 9, 10) and added the model's token (11).
    running.apply_step([generation(0, 8, 9, 10, 11)], cached(0))
    assert entry.tokens == [10, 11, 12, 7, 8, 9, 10, 11] and entry.computed == 7
    # The first block (10, 11, 12, 7) is full and written; the second holds 8, 9, 10 and the
    # unwritten 11: not committed.
    assert cache.cached_prefix([10, 11, 12, 7, 8, 9, 10, 11, 5]) == 4
    running.apply_step([generation(0, 12, 13, final="x")], cached())
    events = drain(entry.stream)
    assert [e.token.id for e in events if type(e) is Token] == [7, 8, 9, 10, 11, 12]
    assert isinstance(events[-1], End) and events[-1].token.id == 13
    assert events[-1].generated_text == "x"
