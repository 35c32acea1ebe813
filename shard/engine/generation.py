"""Turns one forward's logits into each request's next token and its Generation message.

This is the "decode" part of a step (TGI's decode_ns): the shard's work between two forwards,
during which an accelerator idles, so it is built to cost little per request. Tokens and their
logprobs are decided for the whole batch with tensor ops and reach the host in one transfer; the
length/EOS stops are decided there for the whole batch at once (shard/output/stopping.py); then one
short loop per request appends the token to its text and writes its Generation straight into the
step's response (no message is built twice). Stop sequences, prefill logprobs, top tokens and
final texts cost more only for the requests that have them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

from pytgi_proto import generate_pb2
from pytgi_shard.engine.batch import Batch
from pytgi_shard.engine.request_state import RequestState
from pytgi_shard.engine.step_inputs import ForwardInputs, predicted_count
from pytgi_shard.output.detokenizer import Detokenizer
from pytgi_shard.output.stopping import STOP_SEQUENCE
from pytgi_shard.output.wire import GenerationWriter
from pytgi_shard.sample.chooser import top_tokens

NAN = float("nan")
# The `finished` mark of a request that failed (no FinishReason: it did not finish).
FAILED = -1
logger = logging.getLogger(__name__)
_Generations = RepeatedCompositeFieldContainer[generate_pb2.Generation]


@dataclass(slots=True)
class Choice:
    """A step's token choice, decided on the device: what emit_generations turns into messages
    once the host has the ids (the transfer runs while the device may already compute ahead)."""

    transfer: HostTransfer
    prefill: dict[int, generate_pb2.Tokens]
    tops: list[tuple[list[int], list[float]]] | None


class HostTransfer:
    """The step's ids and their logprobs, on their way to the host.

    On a GPU every read is a synchronisation, so the two travel as one float64 tensor (which
    holds each exactly) copied without blocking into pinned memory behind an event: work queued
    after it (the overlap scheduler's next forward) does not delay reading it. On the CPU the
    lists come straight from the tensors.
    """

    def __init__(self, next_ids: torch.Tensor, chosen: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if next_ids.device.type != "cuda":
            self._lists = (next_ids.tolist(), chosen.tolist())
            return
        packed = pack(next_ids, chosen)
        self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        self._host.copy_(packed, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def settle(self) -> None:
        """Waits for the transfer without reading it: the step timeline times the wait apart
        from the host work that follows (wait() is then immediate)."""
        if self._event is not None:
            self._event.synchronize()

    def wait(self) -> tuple[list[int], list[float]]:
        if self._event is None:
            return self._lists
        self._event.synchronize()
        return unpack(self._host)


def pack(next_ids: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """[2, batch] float64: ids and logprobs, each held exactly, for one transfer."""
    return torch.stack((next_ids.double(), chosen.double()))


def unpack(packed: torch.Tensor) -> tuple[list[int], list[float]]:
    return packed[0].long().tolist(), packed[1].tolist()


def choose_tokens(
    batch: Batch, last: torch.Tensor, prefill: dict[int, generate_pb2.Tokens] | None = None
) -> Choice:
    """The device half of a step: next tokens chosen from `last` (one logits row per request,
    in order) and appended to the batch, the results on their way to the host.
    Top tokens read the host here; `prefill` (prefill_tokens) rides along to the Generations."""
    banned = batch.grammar.banned() if batch.grammar is not None else None
    next_ids, logprobs = batch.chooser(last, batch.all_ids, batch.lengths, banned)
    chosen = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
    tops = top_tokens(logprobs, batch.top_n) if batch.top_n is not None else None
    batch.append(next_ids)
    return Choice(HostTransfer(next_ids, chosen), prefill or {}, tops)


def emit_generations(
    batch: Batch, choice: Choice, detokenizer: Detokenizer, writer: GenerationWriter
) -> tuple[generate_pb2.DecodeResponse, list[int]]:
    """The host half: texts, Generations, stop sequences; the ids of the finished requests."""
    ids, lps = choice.transfer.wait()
    if batch.grammar is not None:
        # The constrained rows' next masks: on an accelerator computed in the grammar thread
        # while this step is answered and the next forward runs; on the CPU now.
        batch.grammar.advance(ids)
    requests = batch.requests
    texts = detokenizer.advance(batch.streams, ids)
    response = generate_pb2.DecodeResponse()
    wire = writer.one_token_generations(batch.request_fields, ids, lps, texts)
    response.MergeFromString(wire)
    generations = response.generations
    finished = _finished(
        requests, texts, batch.stops.finished(ids, batch.steps), batch.stop_rows
    )
    if batch.grammar is not None and batch.grammar.failed:
        finished = _fail_rows(generations, requests, finished, batch.grammar.failed)
    if choice.prefill:
        for g in generations:
            if g.request_id in choice.prefill:
                g.prefill_tokens.CopyFrom(choice.prefill[g.request_id])
    if choice.tops is not None:
        _add_top_tokens(generations, requests, choice.tops, detokenizer)
    for row, reason in finished:
        if reason != FAILED:
            set_generated_text(generations[row].generated_text, requests[row], reason, detokenizer)
    return response, [requests[row].id for row, _ in finished]


def _fail_rows(
    generations: _Generations,
    requests: list[RequestState],
    finished: list[tuple[int, int]],
    failed: dict[int, str],
) -> list[tuple[int, int]]:
    """The rows whose grammar's matcher failed leave the batch with the error in their
    Generation (the router fails the request with it) instead of whatever stop the error
    state's EOS-only mask produced; `finished` with them marked FAILED."""
    for row, reason in failed.items():
        message = f"the grammar's matcher failed: {reason}"
        generations[row].error = message
        logger.warning("request %d failed: %s", requests[row].id, message)
    kept = [(row, reason) for row, reason in finished if row not in failed]
    return sorted(kept + [(row, FAILED) for row in failed])


def _finished(
    requests: list[RequestState],
    texts: list[str],
    stopped: list[tuple[int, int]],
    stop_rows: list[int],
) -> list[tuple[int, int]]:
    """(row, FinishReason) of each request that finished, in row order: `stopped` holds the
    length/EOS stops (BatchStops.finished); stop sequences are checked here, for the rows that
    have any and did not stop already."""
    if not stop_rows:
        return stopped
    done = {row for row, _ in stopped}
    matched: list[tuple[int, int]] = [
        (row, STOP_SEQUENCE)
        for row in stop_rows
        if row not in done and requests[row].stopping.matches(texts[row])
    ]
    return sorted(stopped + matched) if matched else stopped


def set_generated_text(
    out: generate_pb2.GeneratedText, r: RequestState, reason: int, detokenizer: Detokenizer
) -> None:
    out.text = detokenizer.decode(r.text.generated_ids, skip_special_tokens=True)
    out.generated_tokens = r.text.generated
    out.finish_reason = reason  # type: ignore[assignment]
    if r.seed is not None:
        out.seed = r.seed


def _add_top_tokens(
    out: _Generations,
    requests: list[RequestState],
    tops: list[tuple[list[int], list[float]]],
    detokenizer: Detokenizer,
) -> None:
    """Each top token decoded alone, with one tokenizer call for the whole batch."""
    texts = iter(detokenizer.token_texts([t for ids, _ in tops for t in ids]))
    special = detokenizer.special_ids
    for g, r, (ids, lps) in zip(out, requests, tops, strict=True):
        top_texts = [next(texts) for _ in ids]
        if r.top_n_tokens:
            _fill_tokens(g.top_tokens.add(), ids, lps, top_texts, special)


def prefill_tokens(
    batch: Batch, logits: torch.Tensor, inputs: ForwardInputs, detokenizer: Detokenizer
) -> dict[int, generate_pb2.Tokens]:
    """Per request that asked for prefill logprobs, the sequence tokens its chunk's rows predict
    with their logprobs (from the raw logits), in order; the chunk at the sequence's start also
    reports its first token, which nothing predicts (NaN). Over all of a prompt's chunks every
    token is reported once."""
    if inputs.prompt_rows is None or inputs.prompt_targets is None:
        return {}
    rows = logits.index_select(0, inputs.prompt_rows)
    logprobs = torch.log_softmax(rows, dim=-1).gather(1, inputs.prompt_targets.unsqueeze(1))
    flat = logprobs.squeeze(1).tolist()
    special = detokenizer.special_ids
    out = {}
    offset = 0
    for row, r in enumerate(batch.requests):
        if not r.prefill_logprobs:
            continue
        count = predicted_count(r.cache_len, r.chunk_end, r.sequence_length)
        first = r.cache_len if r.cache_len == 0 else r.cache_len + 1
        ids = batch.all_ids[row, first : r.cache_len + 1 + count].tolist()
        lps = flat[offset : offset + count]
        offset += count
        if r.cache_len == 0:
            lps = [NAN, *lps]
        tokens = generate_pb2.Tokens()
        _fill_tokens(tokens, ids, lps, detokenizer.token_texts(ids), special)
        out[r.id] = tokens
    return out


def _fill_tokens(
    out: generate_pb2.Tokens,
    ids: list[int],
    logprobs: list[float],
    texts: list[str],
    special: frozenset[int],
) -> None:
    out.ids.extend(ids)
    out.logprobs.extend(logprobs)
    out.texts.extend(texts)
    out.is_special.extend(i in special for i in ids)


def resume_texts(batch: Batch, detokenizer: Detokenizer) -> None:
    """Requests resumed after preemption whose sequence is complete read their generated_ids
    as text (the stop sequences have seen it), before their next token is emitted."""
    for r in batch.requests:
        if r.resumed and r.complete:
            r.stopping.prime(detokenizer.catch_up(r.text))
            r.resumed = 0
