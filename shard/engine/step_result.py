"""A step's outcome (its generations, the batch still running, its times) and the answer the
Engine sends for it: what every Prefill and Decode ends with, whichever kind of step ran."""

from __future__ import annotations

import time
from typing import NamedTuple, TypeVar, cast

from pytgi_proto import generate_pb2
from pytgi_shard.engine.batch import Batch
from pytgi_shard.engine.batch_cache import BatchCache
from pytgi_shard.engine.forward_timer import ForwardTimer
from pytgi_shard.engine.step_timeline import StepClock, StepTimeline

Response = TypeVar("Response", generate_pb2.PrefillResponse, generate_pb2.DecodeResponse)


class StepResult(NamedTuple):
    """One forward and token choice: the generations (in a DecodeResponse, see `reply`), the
    batch of the requests still running (None when all finished), and the forward and decode
    times in ns."""

    generations: generate_pb2.DecodeResponse
    live: Batch | None
    forward_ns: int
    decode_ns: int


def no_sample(clock: StepClock, timer: ForwardTimer, ahead: ForwardTimer | None) -> StepResult:
    """A step whose chunks were all partial: no token chosen; reading the forward's time is its
    synchronisation (on CUDA)."""
    clock.no_sample()
    forward_ns = timer.elapsed_ns()
    clock.device_ns = forward_ns + (ahead.elapsed_ns() if ahead is not None else 0)
    clock.synced = clock.emitted = time.perf_counter_ns()
    return StepResult(generate_pb2.DecodeResponse(), None, forward_ns, 0)


def reply(
    response: type[Response], step: StepResult, start: int, concat_ns: int | None,
    cache: BatchCache, clock: StepClock, timeline: StepTimeline | None,
) -> Response:
    """Caches the step's live batch and answers with its generations and timings.

    A Decode answers with the step's own DecodeResponse, so its Generations (one per request,
    every step) are never copied; a Prefill copies them into its PrefillResponse.
    """
    cache.set(step.live)
    if response is generate_pb2.DecodeResponse:
        out = cast(Response, step.generations)
    else:
        out = response(generations=step.generations.generations)
    if step.live is not None:
        out.batch.CopyFrom(step.live.to_pb())
    out.forward_ns = step.forward_ns
    out.decode_ns = step.decode_ns
    if concat_ns is not None:
        out.concat_ns = concat_ns
    end = time.perf_counter_ns()
    out.total_ns = end - start
    if timeline is not None:
        timeline.record(clock, end)
    return out
