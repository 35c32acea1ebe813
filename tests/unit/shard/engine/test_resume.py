"""A request resumed after preemption (Request.generated_ids) goes on as if never interrupted:
the same tokens (greedy with penalties, and seeded sampling, whose generator is advanced past
the draws of the tokens it had sampled), the same streamed texts after the resume point, the
same final text and token count, stop sequences that span the resume point."""

from __future__ import annotations

import pytest
import torch

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.engine import Engine
from pytgi_shard.output.stopping import STOP_SEQUENCE
from tests.unit.shard.engine.test_engine import Run
from tests.unit.shard.router_steps import (
    Engines,
    Router,
    prompt_of,
    reference_run,
    request,
)

PARAMS = {
    "greedy-penalties": pb.NextTokenChooserParameters(repetition_penalty=1.4, frequency_penalty=0.3),
    "seeded": pb.NextTokenChooserParameters(do_sample=True, seed=42, temperature=1.3, top_k=50),
}




def texts(run: Run, rid: int) -> list[str]:
    return [t for g in run.generations[rid] for t in g.tokens.texts]


def resume(engine: Engine, r: pb.Request, done: list[int], cache_len: int = 0) -> Run:
    """`r` again with `done` as its generated_ids, on fresh blocks (the first cache_len tokens'
    KV already written there by a chunk), run to the end like the router would."""
    again = pb.Request()
    again.CopyFrom(r)
    again.generated_ids[:] = done
    again.prefill_logprobs = False
    router = Router(engine, next_block=40)
    if cache_len:
        router.prefill(1, [router.chunk(again, 0, cache_len)])
    router.prefill(2, [router.chunk(again, cache_len, 0)])
    router.finish()
    return router.run


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("kind", list(PARAMS))
@pytest.mark.parametrize(("cut", "cache_len"), [(1, 0), (5, 0), (7, 9)])
def test_a_resumed_request_continues_the_uninterrupted_run(
    engines: Engines, kind: str, overlap: bool, cut: int, cache_len: int
) -> None:
    engine = engines(overlap)
    r = request(1, prompt_of(6), max_new=12, blocks=[], parameters=PARAMS[kind])
    whole = reference_run(engines(False), [r])
    tokens = whole.tokens[1]
    assert len(tokens) == 12
    resumed = resume(engine, r, tokens[:cut], cache_len)
    assert resumed.tokens[1] == tokens[cut:]
    torch.testing.assert_close(resumed.logprobs[1], whole.logprobs[1][cut:], rtol=1e-4, atol=1e-4)
    assert texts(resumed, 1) == texts(whole, 1)[cut:]
    final, expected = resumed.finals[1], whole.finals[1]
    assert (final.text, final.generated_tokens, final.finish_reason) == (
        expected.text, 12, expected.finish_reason,
    )  # fmt: skip
    if kind == "seeded":
        assert final.seed == 42


def test_a_stop_sequence_may_span_the_resume_point(engines: Engines) -> None:
    engine = engines()
    free = request(1, prompt_of(8, 3), max_new=16, blocks=[])
    run = reference_run(engine, [free])
    pieces = texts(run, 1)
    # The first token k whose text, with the previous character, forms a string seen nowhere
    # earlier: a stop sequence that only the resumed part can complete.
    for k in range(2, len(pieces)):
        before = "".join(pieces[:k])
        if before and pieces[k] and (stop := before[-1] + pieces[k][0]) not in before:
            break
    else:
        pytest.fail("no token to stop at: change the prompt")
    stopped = request(2, prompt_of(8, 3), max_new=16, blocks=[], stop=[stop])
    resumed = resume(engine, stopped, run.tokens[1][:k])
    final = resumed.finals[2]
    assert final.finish_reason == STOP_SEQUENCE
    assert resumed.tokens[2] == [run.tokens[1][k]] and final.generated_tokens == k + 1
    assert final.text == engine.detokenizer.decode(run.tokens[1][: k + 1], skip_special_tokens=True)
