"""Chunked prefill and prefix caching (Request.cache_len / chunk_len) and the mixed Prefill give
the tokens of one whole prefill per request, with the overlap scheduler on and off, on the
reference and the Triton backends (Triton's interpreter on CPU: small cases)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.errors import InvalidRequest
from tests.hf_reference import hf_greedy
from tests.unit.shard.engine.test_engine import Run
from tests.unit.shard.router_steps import (
    Engines,
    Router,
    chunked,
    prompt_of,
    reference_run,
    request,
)


def ids() -> Callable[[], int]:
    return itertools.count(1).__next__


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("size", [1, 7, 16, 64])
def test_a_prompt_in_chunks_gives_the_whole_prefill(
    engines: Engines, size: int, overlap: bool
) -> None:
    prompt = prompt_of(37)
    r = request(1, prompt, max_new=6, blocks=[], prefill_logprobs=True)
    expected = reference_run(engines(), [r])
    router = Router(engines(overlap))
    chunked(router, [r], size, ids())
    router.finish()
    assert router.run.tokens[1] == expected.tokens[1]
    torch.testing.assert_close(router.run.logprobs[1], expected.logprobs[1], rtol=1e-4, atol=1e-4)
    # Prompt logprobs: each chunk reports the tokens its rows predict; together, the prompt.
    chunks = [g.prefill_tokens for g in router.run.generations[1] if g.HasField("prefill_tokens")]
    assert len(chunks) == math.ceil(len(prompt) / size)
    got_ids = [i for c in chunks for i in c.ids]
    got_lps = [x for c in chunks for x in c.logprobs]
    whole = expected.generations[1][0].prefill_tokens
    assert got_ids == list(whole.ids) == prompt
    assert math.isnan(got_lps[0]) and not any(math.isnan(x) for x in got_lps[1:])
    torch.testing.assert_close(got_lps[1:], list(whole.logprobs)[1:], rtol=1e-4, atol=1e-4)
    # Only the last chunk's Generation carries a token; partial ones carry nothing else.
    partial = router.run.generations[1][: len(chunks) - 1]
    assert all(not g.tokens.ids and not g.HasField("generated_text") for g in partial)


def test_partial_prefills_leave_no_state_and_sample_nothing(engines: Engines) -> None:
    engine = engines()
    r = request(1, prompt_of(10), max_new=3, blocks=[1, 2, 3])
    r.chunk_len = 6
    response = engine.prefill(pb.PrefillRequest(batch=pb.Batch(id=1, requests=[r])))
    assert not response.HasField("batch") and not response.generations
    assert len(engine.cache) == 0
    info = engine.info()
    assert info.support_chunking and info.use_prefix_caching
    # The same batch id again (the router's next chunk) is no clash.
    r.cache_len, r.chunk_len = 6, 0
    response = engine.prefill(pb.PrefillRequest(batch=pb.Batch(id=1, requests=[r])))
    assert list(response.batch.request_ids) == [1] and len(response.generations[0].tokens.ids) == 1


@pytest.mark.parametrize("cache_len", [4, 8, 9])
def test_a_cached_prefix_gives_the_cold_tokens(engines: Engines, cache_len: int) -> None:
    """B's first blocks are A's, written by A's run: B computes only after cache_len."""
    engine = engines()
    prompt = prompt_of(14)
    a = request(1, prompt, max_new=5, blocks=[])
    cold = reference_run(engine, [a])  # A on blocks 1-5
    shared = math.ceil(cache_len / engine.block_size)
    b = request(2, prompt, max_new=5, blocks=[1, 2, 3][:shared] + [10, 11, 12, 13][: 5 - shared],
                cache_len=cache_len)  # fmt: skip
    warm = Run(engine)
    warm.finish(warm.prefill(pb.Batch(id=2, requests=[b])))
    assert warm.tokens[2] == cold.tokens[1]
    torch.testing.assert_close(warm.logprobs[2], cold.logprobs[1], rtol=1e-4, atol=1e-4)


MIXED_CASES = [(False, "reference"), (True, "reference"), (False, "triton"), (True, "triton")]


@pytest.mark.parametrize(("overlap", "attention"), MIXED_CASES)
def test_a_mixed_prefill_gives_separate_steps_tokens(
    engines: Engines, overlap: bool, attention: str
) -> None:
    """Newcomers join the running batch's step: one completes at once, one arrives in two
    chunks over two mixed steps; every request's tokens are its solo tokens."""
    if attention == "triton":
        pytest.importorskip("triton")
    a = request(1, prompt_of(6, 1), max_new=7, blocks=[])
    b = request(2, prompt_of(3, 2), max_new=4, blocks=[],
                parameters=pb.NextTokenChooserParameters(repetition_penalty=1.3))  # fmt: skip
    c = request(3, prompt_of(5, 3), max_new=3, blocks=[])
    d = request(4, prompt_of(9, 4), max_new=5, blocks=[], prefill_logprobs=True)
    expected = reference_run(engines(), [a, b, c, d])
    engine = engines(overlap, attention)
    router = Router(engine)
    forwards: list[int] = []
    model_forward = engine.model.forward

    def counted(input_ids: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        forwards.append(int(input_ids.shape[0]))
        return model_forward(input_ids, *args, **kwargs)  # type: ignore[arg-type]

    engine.model.forward = counted  # type: ignore[method-assign]
    try:
        router.prefill(1, [router.chunk(a, 0, 0), router.chunk(b, 0, 0)])
        router.decode()
        forwards.clear()
        mixed = router.prefill(2, [router.chunk(c, 0, 0), router.chunk(d, 0, 4)])
        # Cached first, then the completed newcomer; the partial one is not kept.
        assert list(mixed.batch.request_ids) == [1, 2, 3]
        assert [g.request_id for g in mixed.generations] == [1, 2, 3, 4]
        assert not mixed.generations[3].tokens.ids
        # Overlap: the cached rows' logits were computed ahead; the forward holds the chunks
        # only (then the next look-ahead). Without: one forward of 2 decode rows + 9 tokens.
        assert forwards == ([9, 3] if overlap else [2 + 5 + 4])
        router.prefill(3, [router.chunk(d, 4, 0)])
        router.finish()
    finally:
        engine.model.forward = model_forward  # type: ignore[method-assign]
    assert router.run.tokens == expected.tokens
    for rid, lps in expected.logprobs.items():
        torch.testing.assert_close(router.run.logprobs[rid], lps, rtol=1e-4, atol=1e-4)
    prefill = [x for g in router.run.generations[4] for x in g.prefill_tokens.logprobs]
    whole = list(expected.generations[4][0].prefill_tokens.logprobs)
    torch.testing.assert_close(prefill[1:], whole[1:], rtol=1e-4, atol=1e-4)


def test_chunked_greedy_matches_transformers_generate(engines: Engines) -> None:
    engine = engines()
    prompt = prompt_of(21, 5)
    expected, _ = hf_greedy(engine.settings.model_path, prompt, 8)
    router = Router(engine)
    chunked(router, [request(1, prompt, max_new=8, blocks=[])], 5, ids())
    router.finish()
    assert router.run.tokens[1] == expected


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(cache_len=5), "cache_len 5 leaves no token"),
        (dict(cache_len=2, chunk_len=4), "goes past its 5-token sequence"),
        (dict(generated_ids=[11, 12, 13]), "leave nothing to generate"),
        (dict(blocks=[1]), "needs 6"),
        (dict(blocks=[1, 1]), "listed twice"),
    ],
)
def test_bad_chunks_are_refused(engines: Engines, fields: dict, message: str) -> None:
    blocks = fields.pop("blocks", [1, 2])
    r = request(1, prompt_of(5), max_new=3, blocks=blocks, **fields)
    with pytest.raises(InvalidRequest, match=message):
        engines().prefill(pb.PrefillRequest(batch=pb.Batch(id=1, requests=[r])))
