"""Multi-step decode: one Decode call runs up to `max_steps` decode steps back to back.

On a small model the per-step overhead outside the forward (the router's turn and the gRPC round
trip, ~1-2 ms on a quiet CPU, 5-7 ms loaded at batch 64) is as large as the forward itself. The
router asks for several steps only when nothing could change between them (router/core/
decode_steps.py: no newcomer waiting, no chunk, blocks granted for every step), so running them
here saves a round trip and a router turn per token.

Each step is the engine's own Decode (Engine.decode), called again on the batch it left in the
cache: no second forward path, so the decode graphs, the overlap look-ahead, tensor parallelism
and the step timeline apply per step exactly as for one-step calls. Rows that finish (EOS, max
tokens, a stop sequence, a grammar error) leave the batch as in any step, so the later steps
carry them no more; the call stops early when none is left. Every rank runs the same loop: the
token choices (and so the finishes) are the same on every rank, so the collectives line up.

A newcomer need not wait for the call's end: the router's CutShort stops it after the step it
is on (shard/engine/cut_short.py; the ranks agree on that step), and `step_sizes` says how
many steps ran.
"""

from __future__ import annotations

import time

from pytgi_proto import generate_pb2
from pytgi_proto.contracts import DECODE_STEPS_LIMIT
from pytgi_shard.engine.cut_short import CutShort
from pytgi_shard.engine.engine import Engine
from pytgi_shard.errors import InvalidRequest


def decode_steps(
    engine: Engine, request: generate_pb2.DecodeRequest, cut: CutShort | None = None
) -> generate_pb2.DecodeResponse:
    """Decode with `request.max_steps` steps (0 or 1: exactly Engine.decode), fewer when `cut`
    is asked to stop `request.call_id` (checked before each step after the first, agreed on by
    every rank). The answer holds every step's Generations in step order, `step_sizes` saying
    how many each step produced; forward_ns and decode_ns are the steps' sums, total_ns the
    whole call's, and `batch` the batch left after the last step (unset when every request
    finished)."""
    steps = request.max_steps
    if steps > DECODE_STEPS_LIMIT:
        raise InvalidRequest(f"max_steps must be at most {DECODE_STEPS_LIMIT}, got {steps}")
    start = time.perf_counter_ns()
    out = engine.decode(request)
    if steps <= 1:
        return out
    # The first step's own answer becomes the call's: its Generations are not copied.
    sizes = [len(out.generations)]
    for _ in range(steps - 1):
        if not out.HasField("batch"):
            break
        if cut is not None and cut.agreed(request.call_id, engine.dist):
            break
        step = engine.decode(generate_pb2.DecodeRequest(batches=[out.batch]))
        out.generations.MergeFrom(step.generations)
        sizes.append(len(step.generations))
        out.forward_ns += step.forward_ns
        out.decode_ns += step.decode_ns
        out.drafted_tokens += step.drafted_tokens
        out.drafted_rows += step.drafted_rows
        if step.HasField("batch"):
            out.batch.CopyFrom(step.batch)
        else:
            out.ClearField("batch")
    out.step_sizes.extend(sizes)
    out.total_ns = time.perf_counter_ns() - start
    return out
