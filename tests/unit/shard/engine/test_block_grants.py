"""KV blocks on demand: requests admitted with blocks for their prompt plus one token, then
grown by BlockGrants on Decode and Prefill across block boundaries, give the tokens of a full
allocation; a late grant (the look-ahead ran with no slot) is noticed and its logits dropped;
bad grants are refused and leave the batch as it was."""

from __future__ import annotations

import pytest
import torch

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.decode_graphs import DecodeGraphRunner
from pytgi_shard.errors import InvalidRequest
from tests.unit.shard.router_steps import (
    BLOCK,
    Engines,
    Router,
    prompt_of,
    reference_run,
    request,
)


def requests() -> list[pb.Request]:
    sampled = pb.NextTokenChooserParameters(do_sample=True, seed=5, temperature=1.2)
    return [
        request(1, prompt_of(3, 1), max_new=11, blocks=[]),
        request(2, prompt_of(5, 2), max_new=9, blocks=[], parameters=sampled),
        request(3, prompt_of(2, 3), max_new=6, blocks=[]),
    ]


def grow_on_demand(router: Router, reqs: list[pb.Request]) -> None:
    """Two requests, two decodes, a third mixed in by a Prefill (which grants too), the end."""
    router.prefill(1, [router.chunk(r, 0, 0) for r in reqs[:2]])
    router.decode()
    router.decode()
    router.prefill(2, [router.chunk(reqs[2], 0, 0)])
    router.finish()


# Triton (interpreted on CPU, slow) in the case that exercises the most: overlap, late grants.
CASES = [
    (False, "reference", False), (True, "reference", False), (True, "reference", True),
    (True, "triton", True),
]  # fmt: skip


@pytest.mark.parametrize(("overlap", "attention", "late"), CASES)
def test_blocks_granted_as_sequences_grow_give_the_full_allocation_tokens(
    engines: Engines, overlap: bool, attention: str, late: bool
) -> None:
    if attention == "triton":
        pytest.importorskip("triton")
    reqs = requests()
    expected = reference_run(engines(), reqs)
    router = Router(engines(overlap, attention), late=late)
    grow_on_demand(router, reqs)
    # Admitted with 2, 2 and 1 blocks: every request crossed block boundaries on granted ones.
    assert [len(router.blocks[r.id]) for r in reqs] == [4, 4, 2]
    assert router.run.tokens == expected.tokens
    for rid, lps in expected.logprobs.items():
        torch.testing.assert_close(router.run.logprobs[rid], lps, rtol=1e-4, atol=1e-4)


def test_grants_widen_block_tables_past_the_graph_buffers(engines: Engines) -> None:
    """The runner reads each step's tables: it pads while they fit its buffers, then the steps
    run unpadded, with the same tokens throughout."""
    reqs = requests()
    expected = reference_run(engines(), reqs)
    engine = engines()
    engine.runner.decode_graphs = DecodeGraphRunner(engine.model, (1, 2, 4), 3, BLOCK, pad_eagerly=True)
    router = Router(engine)
    grow_on_demand(router, reqs)
    assert router.run.tokens == expected.tokens


def test_bad_grants_are_refused_and_leave_the_batch_intact(engines: Engines) -> None:
    engine = engines()
    reqs = requests()[:1]
    expected = reference_run(engine, reqs)
    router = Router(engine)
    router.prefill(1, [router.chunk(reqs[0], 0, 0)])
    cached = router.cached
    assert cached is not None
    # The request holds 4 + 1 tokens of blocks: its next forward (position 4) needs a second.
    router.decode()
    cached = router.cached
    assert cached is not None
    held = router.blocks[1]
    num_blocks = engine.runner.kv_cache.num_blocks
    bad = [
        ([pb.BlockGrant(request_id=9, blocks=[50])], "not in the batch"),
        ([pb.BlockGrant(request_id=1, blocks=[num_blocks])], "outside the KV cache"),
        ([pb.BlockGrant(request_id=1, blocks=[held[0]])], "listed twice"),
        ([pb.BlockGrant(request_id=1, blocks=[50]), pb.BlockGrant(request_id=1, blocks=[51])],
         "two BlockGrants"),
    ]  # fmt: skip
    for grants, message in bad:
        with pytest.raises(InvalidRequest, match=message):
            engine.decode(pb.DecodeRequest(batches=[cached], grants=grants))
    # A step whose fed token has no slot is refused the same way: the router decodes until
    # the request's blocks are full, then once more without a grant (its last slot is used),
    # then asks for a step that would need a new block without granting one.
    while router.cached is not None and len(router.blocks[1]) * BLOCK > router.known[1]:
        router.decode()
    assert router.cached is not None
    router.absorb(engine.decode(pb.DecodeRequest(batches=[router.cached])), {})
    assert router.cached is not None
    with pytest.raises(InvalidRequest, match="no KV slot"):
        engine.decode(pb.DecodeRequest(batches=[router.cached]))
    router.finish()
    assert router.run.tokens == expected.tokens
