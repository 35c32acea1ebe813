"""A generate request's way from the HTTP body to its answer: validation, admission into the
inference core (best_of copies), collecting a stream into a result, and the per-request metrics,
timings and span.

Every route (TGI's and OpenAI's) goes through `GenerateFlow.admit`, so request metrics and traces
are recorded in exactly one place. Vocabulary: a `GenerateRequest` (the body) validates into a
`ValidGenerateRequest`; each of its best_of copies is submitted as a `ValidRequest` and followed
here as a `Submission` (its `RequestStream` plus the bookkeeping); a `StreamGroup` holds the
streams of one HTTP request so that a client disconnect cancels them all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry.trace import INVALID_SPAN

from pytgi_proto.parameters import replace_sampling
from pytgi_router.core.errors import IncompleteGenerationError, InferError
from pytgi_router.core.request_stream import End, Prefill, RequestStream, TokenInfo
from pytgi_router.http.http_errors import IncompleteGenerationStreamError, ShuttingDownError
from pytgi_router.http.schemas import GenerateRequest, Sequence
from pytgi_router.http.state import AppState
from pytgi_router.http.validation import ValidGenerateRequest
from pytgi_router.tracing import RequestTrace

log = logging.getLogger("pytgi.router")


class ClientDisconnected(Exception):
    """The client went away; nobody is left to answer."""


class StreamGroup:
    """The RequestStreams of one HTTP request (best_of copies, several prompts), so that a client
    disconnect cancels all of them."""

    __slots__ = ("streams", "cancelled")

    def __init__(self) -> None:
        self.streams: list[RequestStream] = []
        self.cancelled = False

    def add(self, stream: RequestStream) -> None:
        if self.cancelled:
            stream.cancel()
        self.streams.append(stream)

    def cancel(self) -> None:
        self.cancelled = True
        for stream in self.streams:
            stream.cancel()


@dataclass(slots=True)
class Timings:
    start: float
    queued: float
    started: float
    finished: float
    generated_tokens: int
    input_length: int

    @property
    def total(self) -> float:
        return self.finished - self.start

    @property
    def validation(self) -> float:
        return self.queued - self.start

    @property
    def queue(self) -> float:
        return self.started - self.queued

    @property
    def inference(self) -> float:
        return self.finished - self.started

    @property
    def per_token(self) -> float:
        return self.inference / self.generated_tokens if self.generated_tokens else 0.0

    def headers(self, compute_type: str, characters: int) -> dict[str, str]:
        """TGI's response headers (times in whole milliseconds, compute time in seconds)."""
        ms = 1000.0
        return {
            "x-compute-type": compute_type,
            "x-compute-time": f"{self.total:.6f}",
            "x-compute-characters": str(characters),
            "x-total-time": str(int(self.total * ms)),
            "x-validation-time": str(int(self.validation * ms)),
            "x-queue-time": str(int(self.queue * ms)),
            "x-inference-time": str(int(self.inference * ms)),
            "x-time-per-token": str(int(self.per_token * ms)),
            "x-prompt-tokens": str(self.input_length),
            "x-generated-tokens": str(self.generated_tokens),
        }


def summed_headers(timings: list[Timings], compute_type: str, characters: int) -> dict[str, str]:
    """/v1/completions with several prompts: TGI sums the headers over them."""
    out = timings[0].headers(compute_type, characters)
    for key in ("x-total-time", "x-validation-time", "x-queue-time", "x-inference-time",
                "x-time-per-token", "x-prompt-tokens", "x-generated-tokens"):
        out[key] = str(sum(int(t.headers(compute_type, characters)[key]) for t in timings))
    out["x-compute-time"] = f"{sum(t.total for t in timings):.6f}"
    return out


@dataclass(slots=True)
class GenerateResult:
    """A finished non-streaming request."""

    valid: ValidGenerateRequest
    best: Sequence
    others: list[Sequence]
    timings: Timings


class Submission:
    """One submitted ValidRequest as the HTTP side follows it: its stream, span and timings;
    records its outcome (metrics, span, log line) once."""

    __slots__ = ("state", "route", "valid", "stream", "trace", "start", "queued", "done")

    def __init__(
        self, state: AppState, route: str, valid: ValidGenerateRequest, stream: RequestStream,
        trace: RequestTrace, start: float, queued: float,
    ) -> None:
        self.state = state
        self.route = route
        self.valid = valid
        self.stream = stream
        self.trace = trace
        self.start = start
        self.queued = queued
        self.done = False

    def succeed(self, end: End) -> Timings:
        now = time.monotonic()
        queued = end.queued_at or self.queued
        started = end.started_at or queued
        finished = max(end.finished_at or now, started)
        t = Timings(self.start, queued, started, finished, end.generated_tokens,
                    self.valid.request.input_length)
        if self.done:
            return t
        self.done = True
        m = self.state.metrics
        m.request_success.inc()
        m.request_duration.observe(now - self.start)
        m.request_validation_duration.observe(t.validation)
        m.request_queue_duration.observe(t.queue)
        m.request_inference_duration.observe(t.inference)
        m.request_mean_time_per_token_duration.observe(t.per_token)
        m.request_generated_tokens.observe(end.generated_tokens)
        request = self.valid.request
        if request.adapter_name:
            live = self.state.infer.adapters.get(request.adapter_name)
            if live is not None and live.key == request.adapter_key:
                m.adapter_served(request.adapter_name, end.generated_tokens)
        self.trace.phases(queued, started, finished)
        self.trace.set({
            "total_time": t.total, "validation_time": t.validation, "queue_time": t.queue,
            "inference_time": t.inference, "time_per_token": t.per_token, "seed": end.seed,
            "generated_tokens": end.generated_tokens, "finish_reason": end.finish_reason,
        })
        self.trace.end()
        log.info(
            "%s: %d tokens (%s) in %.3fs: validation %.1fms, queue %.1fms, inference %.3fs, "
            "%.1fms/token", self.route, end.generated_tokens, end.finish_reason, t.total,
            t.validation * 1e3, t.queue * 1e3, t.inference, t.per_token * 1e3,
        )
        return t

    def fail(self, err: InferError) -> None:
        if self.done:
            return
        self.done = True
        self.state.metrics.request_failure.labels(err=err.metric_label).inc()
        self.trace.end(err)
        log.warning("%s failed: %s", self.route, err.message)

    def dropped(self) -> None:
        """The client went away before the end (TGI's `dropped` failure)."""
        if self.done:
            return
        self.done = True
        self.state.metrics.request_failure.labels(err="dropped").inc()
        self.trace.end()

    def incomplete(self, group: StreamGroup | None, *, streaming: bool) -> Exception:
        """The stream ended without its End: a drop if the client left, else an error."""
        if group is not None and group.cancelled:
            self.dropped()
            return ClientDisconnected()
        err: InferError = (
            IncompleteGenerationStreamError() if streaming else IncompleteGenerationError()
        )
        self.fail(err)
        return err


class GenerateFlow:
    """Validates, admits and collects generate requests for every route."""

    def __init__(self, state: AppState) -> None:
        self.state = state

    async def admit(
        self, req: GenerateRequest, *, stream: bool, route: str, headers: Mapping[str, str],
        group: StreamGroup,
    ) -> list[Submission]:
        """Validates and submits (best_of copies); raises InferError, counted as a failure."""
        state = self.state
        start = time.monotonic()
        m = state.metrics
        m.request_count.inc()
        trace = state.tracing.request(route, headers)
        try:
            if state.draining:
                raise ShuttingDownError()
            with trace.child("validation"):
                valid = await state.validator.validate(req, stream=stream)
            m.request_input_length.observe(valid.request.input_length)
            m.request_max_new_tokens.observe(valid.request.stopping.max_new_tokens)
            return self._submit(route, valid, trace, start, group)
        except InferError as err:
            m.request_failure.labels(err=err.metric_label).inc()
            trace.end(err)
            log.info("%s refused (%d): %s", route, err.status_code, err.message)
            raise

    def _submit(
        self, route: str, valid: ValidGenerateRequest, trace: RequestTrace, start: float,
        group: StreamGroup,
    ) -> list[Submission]:
        requests = [valid.request]
        for _ in range(valid.best_of - 1):
            # best_of samples N independent submissions: each gets its own seed.
            seed = self.state.validator.random_seed()
            sampling = replace_sampling(valid.request.sampling, seed=seed)
            requests.append(dataclasses.replace(valid.request, sampling=sampling))
        queued = time.monotonic()
        streams: list[RequestStream] = []
        try:
            with trace.current():
                for request in requests:
                    streams.append(self.state.infer.submit(request))
        except InferError:
            for s in streams:
                s.cancel()
            raise
        for s in streams:
            group.add(s)
        submissions = [Submission(self.state, route, valid, streams[0], trace, start, queued)]
        for s in streams[1:]:
            # best_of siblings: the first submission owns the request's metrics and span.
            sibling = Submission(
                self.state, route, valid, s, RequestTrace(INVALID_SPAN), start, queued
            )
            sibling.done = True
            submissions.append(sibling)
        return submissions

    async def collect(
        self, submission: Submission, group: StreamGroup | None = None
    ) -> tuple[Sequence, Timings]:
        """Reads a whole stream (non-streaming routes)."""
        prefill: list[TokenInfo] = []
        tokens: list[TokenInfo] = []
        top: list[list[TokenInfo]] = []
        try:
            async for ev in submission.stream:
                if type(ev) is Prefill:
                    prefill = ev.tokens
                    continue
                tokens.append(ev.token)  # type: ignore[union-attr]
                top.append(ev.top_tokens)  # type: ignore[union-attr]
                if type(ev) is End:
                    timings = submission.succeed(ev)
                    text = ev.generated_text
                    if submission.valid.return_full_text:
                        text = submission.valid.request.inputs + text
                    input_length = submission.valid.request.input_length
                    seq = Sequence(text, ev, prefill, tokens, top, input_length)
                    return seq, timings
        except InferError as err:
            submission.fail(err)
            raise
        except asyncio.CancelledError:
            submission.dropped()
            raise
        raise submission.incomplete(group, streaming=False)

    async def generate(
        self, req: GenerateRequest, *, route: str, headers: Mapping[str, str], group: StreamGroup
    ) -> GenerateResult:
        """A non-streaming request: the best of its submissions, the others, the best one's
        timings."""
        submissions = await self.admit(req, stream=False, route=route, headers=headers, group=group)
        valid = submissions[0].valid
        if len(submissions) == 1:
            seq, timings = await self.collect(submissions[0], group)
            return GenerateResult(valid, seq, [], timings)
        tasks = [asyncio.ensure_future(self.collect(g, group)) for g in submissions]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException as err:
            if isinstance(err, InferError):
                submissions[0].fail(err)
            for g in submissions:
                g.stream.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        ranked = sorted(results, key=lambda r: r[0].mean_logprob, reverse=True)
        best, best_timings = ranked[0]
        return GenerateResult(valid, best, [seq for seq, _ in ranked[1:]], best_timings)
