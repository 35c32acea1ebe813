"""Cutting a multi-step Decode short (shard/engine/cut_short.py, multi_step.py): a CutShort set
from another thread while the call runs stops it after the step it is on; the batch it leaves
is the cache's, and decoding on (more Decodes, or a newcomer's mixed Prefill) gives what an
uninterrupted run gives. On two ranks only one rank is told, and both stop at the same step."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.cut_short import CutShort
from pytgi_shard.engine.engine import Engine
from pytgi_shard.engine.multi_step import decode_steps
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import ShardSettings
from tests.unit.shard.engine.test_multi_step import BLOCK, _batch, _engine, _request, _steps
from tests.unit.shard.models.test_models import _free_port

CALL = 41


def test_the_flag_names_one_call() -> None:
    cut = CutShort()
    assert not cut.wanted(CALL)
    cut.request(CALL)
    assert cut.wanted(CALL) and not cut.wanted(CALL + 1)
    # A call without an id (a router that never cuts) is never stopped.
    assert not cut.wanted(0)
    cut.reset()
    assert not cut.wanted(CALL)


def _cut_after(engine: Engine, cut: CutShort, steps: int) -> threading.Thread:
    """Sets `cut` for CALL from another thread (as the service's event loop does) once the
    engine finished `steps` decode steps, holding the engine thread until it is set."""
    finished = threading.Semaphore(0)
    flagged = threading.Event()
    plain = engine.decode
    count = 0

    def decode(request: pb.DecodeRequest) -> pb.DecodeResponse:
        nonlocal count
        out = plain(request)
        count += 1
        if count == steps:
            finished.release()
            assert flagged.wait(10), "the other thread never set the flag"
        return out

    def flag() -> None:
        finished.acquire()
        cut.request(CALL)
        flagged.set()

    engine.decode = decode  # type: ignore[method-assign]
    thread = threading.Thread(target=flag)
    thread.start()
    return thread


def _serialised(out: pb.DecodeResponse) -> list[list[bytes]]:
    sizes = list(out.step_sizes) or [len(out.generations)]
    steps, at = [], 0
    for size in sizes:
        steps.append([g.SerializeToString() for g in out.generations[at:at + size]])
        at += size
    return steps


@pytest.mark.parametrize("overlap", [False, True])
def test_a_cut_call_stops_after_its_step_and_decoding_goes_on_exactly(
    tiny_model: Callable[..., Path], overlap: bool
) -> None:
    engine = _engine(tiny_model("llama"), overlap)
    uninterrupted, _ = _steps(engine, 8)
    engine.clear(None)
    response = engine.prefill(pb.PrefillRequest(batch=_batch()))
    steps = [[g.SerializeToString() for g in response.generations]]
    cut = CutShort()
    thread = _cut_after(engine, cut, 3)
    out = decode_steps(engine, pb.DecodeRequest(batches=[response.batch], max_steps=8,
                                                call_id=CALL), cut)
    thread.join()
    del engine.decode  # the plain method again
    assert len(out.step_sizes) == 3
    steps += _serialised(out)
    # The batch answered is the one the cache holds.
    assert engine.cache.get(out.batch.id).request_ids == list(out.batch.request_ids)
    # The flag stays for that call only: the next calls run their steps.
    cached: pb.CachedBatch | None = out.batch
    while cached is not None:
        out = decode_steps(engine, pb.DecodeRequest(batches=[cached], max_steps=8,
                                                    call_id=CALL + 1), cut)
        steps += _serialised(out)
        cached = out.batch if out.HasField("batch") else None
    assert steps == uninterrupted
    assert len(engine.cache) == 0 and len(engine.runner.lookaheads) == 0


def _tokens(generations: object) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for g in generations:  # type: ignore[attr-defined]
        out.setdefault(g.request_id, []).extend(g.tokens.ids)
    return out


def test_the_newcomer_prefill_after_a_cut_leaves_the_running_rows_tokens_alone(
    tiny_model: Callable[..., Path]
) -> None:
    """What the router does next: a Prefill of the newcomer mixed with the cut batch's rows."""
    engine = _engine(tiny_model("llama"), False)
    uninterrupted, _ = _steps(engine, 8)
    expected: dict[int, list[int]] = {}
    for step in uninterrupted:
        for raw in step:
            g = pb.Generation.FromString(raw)
            expected.setdefault(g.request_id, []).extend(g.tokens.ids)
    engine.clear(None)
    response = engine.prefill(pb.PrefillRequest(batch=_batch()))
    got = _tokens(response.generations)
    cut = CutShort()
    thread = _cut_after(engine, cut, 2)
    out = decode_steps(engine, pb.DecodeRequest(batches=[response.batch], max_steps=8,
                                                call_id=CALL), cut)
    thread.join()
    del engine.decode
    assert len(out.step_sizes) == 2
    for rid, ids in _tokens(out.generations).items():
        got.setdefault(rid, []).extend(ids)
    newcomer = _request(9, [3, 4, 5, 6], 4, 40)
    mixed = engine.prefill(pb.PrefillRequest(batch=pb.Batch(id=2, requests=[newcomer]),
                                             cached_batch=out.batch))
    for rid, ids in _tokens(mixed.generations).items():
        got.setdefault(rid, []).extend(ids)
    cached = mixed.batch if mixed.HasField("batch") else None
    while cached is not None:
        step = decode_steps(engine, pb.DecodeRequest(batches=[cached], max_steps=8))
        for rid, ids in _tokens(step.generations).items():
            got.setdefault(rid, []).extend(ids)
        cached = step.batch if step.HasField("batch") else None
    newcomer_tokens = got.pop(9)
    assert got == expected
    assert len(newcomer_tokens) == 4


def _rank_main(rank: int, port: int, model: Path, out: Path) -> None:
    """Both ranks run the same calls; only rank 1 is told to cut the first short, after the
    step it is on when the flag comes (its third)."""
    torch.set_num_threads(1)
    settings = ShardSettings(model_path=model, block_size=BLOCK, rank=rank, world_size=2,
                             master_port=port)
    engine = load_engine(settings)
    try:
        engine.warmup(pb.WarmupRequest(max_prefill_tokens=64, max_batch_total_tokens=1024))
        response = engine.prefill(pb.PrefillRequest(batch=_batch()))
        steps = [[g.SerializeToString() for g in response.generations]]
        cut = CutShort()
        thread = _cut_after(engine, cut, 3) if rank == 1 else None
        first = decode_steps(engine, pb.DecodeRequest(batches=[response.batch], max_steps=8,
                                                      call_id=CALL), cut)
        if thread is not None:
            thread.join()
            del engine.decode
        steps += _serialised(first)
        cached = first.batch if first.HasField("batch") else None
        while cached is not None:
            out_ = decode_steps(engine, pb.DecodeRequest(batches=[cached], max_steps=8,
                                                         call_id=CALL + 1), cut)
            steps += _serialised(out_)
            cached = out_.batch if out_.HasField("batch") else None
        torch.save((len(first.step_sizes), steps), out / f"rank{rank}.pt")
    finally:
        engine.dist.close()


def test_two_ranks_stop_at_the_same_step_when_one_is_told(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    model = tiny_model("llama", sharded=True)
    mp.spawn(_rank_main, args=(_free_port(), model, tmp_path), nprocs=2, join=True)
    one = load_engine(ShardSettings(model_path=model, block_size=BLOCK))
    one.warmup(pb.WarmupRequest(max_prefill_tokens=64, max_batch_total_tokens=1024))
    expected, _ = _steps(one, 8)
    ran = set()
    for rank in range(2):
        first, steps = torch.load(tmp_path / f"rank{rank}.pt")
        ran.add(first)
        tokens = [[list(pb.Generation.FromString(g).tokens.ids) for g in s] for s in steps]
        assert tokens == [[list(pb.Generation.FromString(g).tokens.ids) for g in s]
                          for s in expected]
    # Rank 0 never saw the flag, yet stopped where rank 1 did (the all-reduce).
    assert ran == {3}
