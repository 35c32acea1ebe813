"""The overlap scheduler (shard/engine/lookahead.py) changes when a forward runs, never what it computes.

The same router-like call sequence runs on an engine without overlap and on one that queues each
step's next decode forward ahead (forced on here; on the CPU it is off by default): every
response must be the same (logprobs to the rounding a change of batch composition brings),
through concatenation (a Prefill joining a running batch), a router
FilterBatch, requests finishing by length, stop sequence and with no slot left for a look-ahead,
seeded sampling, and a Decode that lists two batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.batch import Batch
from pytgi_shard.engine.engine import Engine
from pytgi_shard.engine.forward_timer import ForwardTimer
from pytgi_shard.engine.lookahead import Lookahead, Lookaheads
from pytgi_shard.engine.request_state import BatchContext
from pytgi_shard.sample.chooser import Watermark
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import ShardSettings

BLOCK = 4


def _engine(model: Path, overlap: bool) -> Engine:
    engine = load_engine(ShardSettings(model_path=model, block_size=BLOCK, overlap=overlap))
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=64, max_batch_total_tokens=1024))
    return engine


def _request(rid: int, prompt: list[int], max_new: int, first_block: int, **kw: object) -> pb.Request:
    """Blocks for exactly prompt + max_new - 1 tokens: the last token never gets a slot, so a
    look-ahead for a request that just finished by length has none (block 0 takes its write)."""
    blocks = math.ceil((len(prompt) + max_new - 1) / BLOCK)
    params = kw.pop("parameters", pb.NextTokenChooserParameters())
    return pb.Request(
        id=rid, input_ids=prompt, parameters=params,
        stopping_parameters=pb.StoppingCriteriaParameters(
            max_new_tokens=max_new, ignore_eos_token=True,
            stop_sequences=list(kw.pop("stop", ())),  # type: ignore[call-overload]
        ),
        blocks=list(range(first_block, first_block + blocks)),
    )  # fmt: skip


def _script(engine: Engine) -> list[bytes]:
    """A router's calls: every response, serialised without its timings."""
    out: list[bytes] = []

    def keep(response: pb.PrefillResponse | pb.DecodeResponse) -> pb.CachedBatch | None:
        response.ClearField("forward_ns")
        response.ClearField("decode_ns")
        response.ClearField("total_ns")
        response.ClearField("concat_ns")
        out.append(response.SerializeToString(deterministic=True))
        return response.batch if response.HasField("batch") else None

    sampled = pb.NextTokenChooserParameters(do_sample=True, temperature=0.8, top_k=20, seed=7)
    first = pb.Batch(id=1, requests=[
        _request(1, [5, 6, 7, 8, 9], 3, 1),
        _request(2, [10, 11, 12], 9, 4, parameters=sampled),
        _request(3, [13, 14, 15, 16, 17, 18, 19], 12, 8, stop=["x"]),
    ])  # fmt: skip
    cached = keep(engine.prefill(pb.PrefillRequest(batch=first)))
    assert cached is not None
    cached = keep(engine.decode(pb.DecodeRequest(batches=[cached])))
    # A newcomer joins the running batch; one of its requests finishes at once.
    second = pb.Batch(id=2, requests=[_request(4, [20, 21], 1, 14), _request(5, [22, 23], 6, 16)])
    prefill = pb.PrefillRequest(batch=second)
    prefill.cached_batch.CopyFrom(cached)
    cached = keep(engine.prefill(prefill))
    assert cached is not None
    cached = keep(engine.decode(pb.DecodeRequest(batches=[cached])))
    assert cached is not None
    # The router drops a request (a client went away) between two steps.
    kept = [r for r in cached.request_ids if r != 5]
    filtered = engine.filter(cached.id, kept)
    assert filtered is not None
    cached = filtered
    # A third batch decodes together with the running one (a Decode of two batches).
    third = pb.Batch(id=3, requests=[_request(6, [24, 25, 26], 5, 20)])
    other = keep(engine.prefill(pb.PrefillRequest(batch=third)))
    assert other is not None
    both: list[pb.CachedBatch] = [cached, other]
    while both:
        nxt = keep(engine.decode(pb.DecodeRequest(batches=both)))
        both = [nxt] if nxt is not None else []
    return out


def test_overlap_gives_the_same_responses(tiny_model: Callable[..., Path]) -> None:
    model = tiny_model("llama")
    plain, ahead = _engine(model, overlap=False), _engine(model, overlap=True)
    assert not plain.overlap and ahead.overlap

    expected, got = _script(plain), _script(ahead)

    assert len(got) == len(expected) > 6
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        ours, theirs = pb.DecodeResponse.FromString(a), pb.DecodeResponse.FromString(b)
        # Rows computed ahead in a smaller batch (a newcomer's first decode) may round their
        # logits differently, as any change of batch composition does; all else is identical.
        for g in (*ours.generations, *theirs.generations):
            lps = list(g.tokens.logprobs)
            g.tokens.ClearField("logprobs")
            g.tokens.logprobs.extend(round(x, 4) for x in lps)
        assert ours == theirs, f"response {step} differs with overlap"
    # Everything finished: no look-ahead is left holding memory.
    assert len(ahead.runner.lookaheads) == 0


def test_a_decode_uses_the_forward_computed_ahead(tiny_model: Callable[..., Path]) -> None:
    engine = _engine(tiny_model("llama"), overlap=True)
    calls = 0
    forward = engine.model.forward

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return forward(*args, **kwargs)  # type: ignore[arg-type]

    engine.model.forward = counting  # type: ignore[method-assign]
    batch = pb.Batch(id=1, requests=[_request(1, [5, 6, 7], 6, 1)])
    cached = engine.prefill(pb.PrefillRequest(batch=batch)).batch
    assert (calls, len(engine.runner.lookaheads)) == (2, 1)  # the prefill, then the look-ahead
    engine.decode(pb.DecodeRequest(batches=[cached]))
    # One forward per decode step: the look-ahead for the next one, none for this one.
    assert (calls, len(engine.runner.lookaheads)) == (3, 1)
    engine.clear(None)
    assert len(engine.runner.lookaheads) == 0


def test_lookahead_inputs_keep_finished_rows_inside_their_blocks() -> None:
    ctx = BatchContext(torch.device("cpu"), BLOCK, 16, 64, frozenset(), Watermark(0.5, 2.0))
    # Request 1 fills its one block after 4 tokens; request 2 has room.
    batch = Batch.from_pb(pb.Batch(id=1, requests=[
        _request(1, [5, 6, 7], 2, 1), _request(2, [8, 9], 4, 2),
    ]), ctx)  # fmt: skip
    batch.append(torch.tensor([3, 3]))
    batch.append(torch.tensor([3, 3]))  # request 1's next position (4) has no slot
    inputs = batch.lookahead_inputs()
    assert inputs.meta.slot_mapping.tolist() == [0, 2 * BLOCK + 3]
    assert inputs.meta.seqlens_k.tolist() == [4, 4]
    assert inputs.positions.tolist() == [4, 3]


def test_lookaheads_take_reorders_and_refuses_unknown_requests() -> None:
    timer = ForwardTimer(torch.device("cpu"))
    timer.stop()
    pending = Lookaheads()
    pending.add(Lookahead([1, 2], torch.tensor([[1.0], [2.0]]), timer))
    pending.add(Lookahead([7], torch.tensor([[7.0]]), timer))
    taken = pending.take([7, 1])
    assert taken is not None and taken[0].tolist() == [[7.0], [1.0]]
    assert len(pending) == 0
    pending.add(Lookahead([1, 2], torch.tensor([[1.0], [2.0]]), timer))
    assert pending.take([1, 9]) is None and len(pending) == 0


@pytest.mark.parametrize("flag", [["--overlap"], ["--no-overlap"], []])
def test_overlap_flag(flag: list[str], tmp_path: Path) -> None:
    from pytgi_shard.service.cli import build_parser, settings_from_args

    args = build_parser().parse_args(["serve", str(tmp_path), *flag])
    assert settings_from_args(args, {}).overlap == {"--overlap": True, "--no-overlap": False}.get(flag[0] if flag else "")
