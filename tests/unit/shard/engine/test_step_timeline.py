"""The step timeline (shard/engine/step_timeline.py): the ring, and what an engine records.

The ring hands every row once, in order, and counts what the reader lost when it fell a ring
behind; the engine records one row per Prefill/Decode with its kind, size and phases (which
add up to the step exactly, since each phase is the distance between two stamps), none for
Warmup, and none when the timeline is off.
"""

from __future__ import annotations

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.step_timeline import (
    COLUMNS,
    DECODE,
    PHASES,
    StepClock,
    StepTimeline,
    as_records,
)
from tests.unit.shard.router_steps import Engines, prompt_of, request


def _clock(start: int) -> StepClock:
    clock = StepClock()
    clock.begin(start, DECODE)
    clock.launch, clock.forwarded, clock.chosen = start + 1, start + 3, start + 6
    clock.ahead, clock.synced, clock.emitted = start + 10, start + 15, start + 21
    clock.requests, clock.tokens, clock.device_ns = 2, 2, 7
    return clock


def test_rows_hold_each_phase_as_the_distance_between_two_stamps() -> None:
    timeline = StepTimeline(8)
    timeline.record(_clock(100), 128)
    (record,) = as_records(timeline.drain())
    assert record == {"t_ns": 100, "end_ns": 128, "kind": "decode", "requests": 2, "tokens": 2,
                      "build_ns": 1, "forward_ns": 2, "choose_ns": 3, "ahead_ns": 4,
                      "sync_ns": 5, "emit_ns": 6, "reply_ns": 7, "device_ns": 7}
    assert list(record) == list(COLUMNS)
    assert timeline.drain() == [] and len(timeline) == 0


def test_a_reader_a_ring_behind_gets_the_newest_rows_and_counts_the_rest() -> None:
    timeline = StepTimeline(4)
    for i in range(10):
        timeline.record(_clock(1000 * i), 1000 * i + 50)
    assert len(timeline) == 4
    # The oldest slot may be the one being written: at most capacity - 1 rows come back.
    assert [row[0] for row in timeline.drain()] == [7000, 8000, 9000]
    assert timeline.dropped == 7
    timeline.record(_clock(10_000), 10_050)
    assert [row[0] for row in timeline.drain()] == [10_000] and timeline.dropped == 7


def _steps(engine_factory: Engines, timeline: StepTimeline | None) -> list[dict[str, int | str]]:
    """A router's calls: a prefill of two requests, a decode, a newcomer's partial chunk alone,
    then its last chunk mixed into the running batch's step, then decodes to the end."""
    engine = engine_factory(overlap=True)
    engine.timeline = timeline
    try:
        first = pb.Batch(id=1, requests=[request(1, prompt_of(5), 4, [1, 2, 3]),
                                         request(2, prompt_of(3, 1), 4, [4, 5])])
        cached = engine.prefill(pb.PrefillRequest(batch=first)).batch
        cached = engine.decode(pb.DecodeRequest(batches=[cached])).batch
        newcomer = request(3, prompt_of(8, 2), 2, [6, 7, 8], chunk_len=4)
        engine.prefill(pb.PrefillRequest(batch=pb.Batch(id=2, requests=[newcomer])))
        newcomer.cache_len, newcomer.chunk_len = 4, 0
        mixed = pb.PrefillRequest(batch=pb.Batch(id=3, requests=[newcomer]))
        mixed.cached_batch.CopyFrom(cached)
        response = engine.prefill(mixed)
        while response.HasField("batch"):
            response = engine.decode(pb.DecodeRequest(batches=[response.batch]))
    finally:
        engine.timeline = None
        engine.clear(None)
    return as_records(timeline.drain()) if timeline is not None else []


def test_the_engine_records_every_step_with_its_kind_size_and_phases(engines: Engines) -> None:
    timeline = StepTimeline()
    records = _steps(engines, timeline)
    kinds = [(r["kind"], r["requests"], r["tokens"]) for r in records]
    # Prefill of 5 + 3 tokens; a decode; the newcomer's first 4-token chunk; its last 4 tokens
    # beside the 2 decode rows (their logits computed ahead: 1 token each); then decodes.
    assert kinds[:4] == [("prefill", 2, 8), ("decode", 2, 2), ("prefill", 1, 4), ("mixed", 3, 6)]
    assert {k for k in kinds[4:]} <= {("decode", 3, 3), ("decode", 2, 2), ("decode", 1, 1)}
    assert len(kinds) > 4
    for r in records:
        phases = [int(r[p]) for p in PHASES]
        assert min(phases) >= 0
        assert sum(phases) == int(r["end_ns"]) - int(r["t_ns"])
        assert int(r["device_ns"]) > 0
    starts = [int(r["t_ns"]) for r in records]
    assert starts == sorted(starts)
    # Overlap: every decode after the first took logits computed ahead, so no forward of its
    # own; the look-ahead it launched is its 'ahead' phase, the forward's time its device time.
    assert all(int(r["forward_ns"]) == 0 and int(r["ahead_ns"]) > 0
               for r in records[1:] if r["kind"] == "decode")
    # The partial chunk chose no token: nothing after its forward but the wait and the reply.
    partial = records[2]
    assert int(partial["choose_ns"]) == int(partial["ahead_ns"]) == int(partial["emit_ns"]) == 0
    # On the CPU the tokens are on the host when chosen: the wait is measured, and tiny.
    assert all(int(r["sync_ns"]) < int(r["device_ns"]) for r in records if r["kind"] == "decode")


def test_an_engine_without_a_timeline_records_nothing_and_warmup_never(engines: Engines) -> None:
    assert _steps(engines, None) == []
    engine = engines(overlap=True)
    timeline = StepTimeline()
    engine.timeline = timeline
    try:
        engine.warmup(pb.WarmupRequest(max_prefill_tokens=128, max_batch_total_tokens=2048))
        assert len(timeline) == 0 and engine.timeline is timeline
    finally:
        engine.timeline = None
