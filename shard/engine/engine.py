"""One rank's engine: the RPC verbs, the batch cache, and each step's token choice.

The model, its KV cache, the decode graphs, the look-aheads and Warmup's sizing are the model
runner's (shard/engine/model_runner.py): the engine builds a step's inputs from its batches,
asks the runner for the logits, samples, and answers.

Every rank runs every call in the same order (the router fans out and waits), so the
tensor-parallel collectives inside the model line up; sampling runs redundantly on every rank
with the same seeds, so every rank's answer is the same and rank 0's is used.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext

import torch
from opentelemetry import trace

from pytgi_proto import generate_pb2
from pytgi_shard.device.distributed import Dist
from pytgi_shard.engine.adapter_verbs import install_adapter, read_adapter, unload_adapter
from pytgi_shard.engine.batch import Batch
from pytgi_shard.engine.batch_cache import BatchCache
from pytgi_shard.engine.block_grants import Grants, apply_grants, checked_grants
from pytgi_shard.engine.draft_model import DraftModel
from pytgi_shard.engine.drafter import Drafter, NgramDrafter
from pytgi_shard.engine.drafting import DRAFTING_BATCH, Drafts
from pytgi_shard.engine.eagle3 import Eagle3Drafter
from pytgi_shard.engine.encoder_decoder_batch import (
    Encoding,
    decoder_inputs,
    new_batch,
    prefill_inputs,
)
from pytgi_shard.engine.forward_timer import ForwardTimer
from pytgi_shard.engine.generation import (
    choose_tokens,
    emit_generations,
    prefill_tokens,
    resume_texts,
)
from pytgi_shard.engine.hidden_drafter import HiddenStateDrafter
from pytgi_shard.engine.info import info_response
from pytgi_shard.engine.model_runner import ModelRunner
from pytgi_shard.engine.prefill_ladder import resolve_prefill
from pytgi_shard.engine.request_state import BatchContext
from pytgi_shard.engine.request_validation import check_decode_batches, check_new_batch
from pytgi_shard.engine.step_inputs import ForwardInputs
from pytgi_shard.engine.step_result import StepResult, no_sample, reply
from pytgi_shard.engine.step_timeline import DECODE, MIXED, PREFILL, StepClock, StepTimeline
from pytgi_shard.engine.verification import Verifying, kept_tokens, step_drafts, verify_inputs
from pytgi_shard.engine.warmup import warmup_limits, warmup_response
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.lora.adapter_set import AdapterSet, HostAdapter, place_adapters
from pytgi_shard.models.encoder_decoder_model import EncoderDecoderModel
from pytgi_shard.models.model import Model
from pytgi_shard.output.detokenizer import Detokenizer
from pytgi_shard.output.wire import GenerationWriter
from pytgi_shard.sample.chooser import Watermark
from pytgi_shard.settings import ShardSettings
from pytgi_shard.structured_output.compiler import GrammarCompiler
from pytgi_shard.structured_output.worker import MaskWorker


class Engine:
    def __init__(
        self, model: Model, detokenizer: Detokenizer, dist: Dist, settings: ShardSettings,
        adapters: AdapterSet | None = None,
        draft: DraftModel | HiddenStateDrafter | Eagle3Drafter | None = None,
    ) -> None:
        self.model = model
        # The LoRA adapters attached to the model (--lora-adapters; shard/lora/).
        self.adapters = adapters or AdapterSet()
        self.detokenizer = detokenizer
        # Each step's Generations, as wire bytes (shard/output/wire.py).
        self.writer = GenerationWriter(detokenizer.special_ids)
        self.dist = dist
        self.settings = settings
        self.block_size = settings.block_size
        self.watermark = Watermark(settings.watermark_gamma, settings.watermark_delta)
        self.cache = BatchCache()
        self.tracer = trace.get_tracer("pytgi.shard")
        # Each step's phases (shard/engine/step_timeline.py): stamped always, recorded when
        # --step-timeline asks, on rank 0 only (every rank runs the same steps).
        self.clock = StepClock()
        self.timeline = (
            StepTimeline() if settings.step_timeline is not None and dist.rank == 0 else None
        )
        # The model, its KV cache (block 0 only until Warmup), decode graphs and look-aheads.
        self.runner = ModelRunner(model, dist, settings, self.adapters.rows, draft)
        # Who proposes the drafts: the draft model or speculator heads (--speculator-model),
        # else the n-gram index.
        self.drafter: Drafter = draft if draft is not None else NgramDrafter()
        # An encoder-decoder's requests run as their decoder's (shard/engine/encoder_decoder_batch.py).
        self.encoder_decoder = isinstance(model, EncoderDecoderModel)
        # Drafts per row and decode step (--speculate; shard/engine/drafting.py); not for an
        # encoder-decoder (its decoder's steps are not the varlen path verification takes).
        self.speculate = 0 if self.encoder_decoder else settings.speculate
        # The largest batch that drafts (drafting.DRAFTING_BATCH; tests raise it).
        self.drafting_batch = DRAFTING_BATCH
        # The overlap scheduler (shard/engine/lookahead.py): on by default where the forward runs
        # asynchronously (dist.caps.async_forward: CUDA); on the CPU it would only compute ahead
        # what it waits for anyway. Not for an encoder-decoder: its decode inputs are not the
        # batch's look-ahead inputs.
        # While speculating, only for batches too large to draft (_sample): a step's drafts
        # come from the previous step's tokens, which a look-ahead queues its forward without
        # (a step with a look-ahead takes the plain path).
        self.overlap = not self.encoder_decoder and (
            settings.overlap if settings.overlap is not None else dist.caps.async_forward
        )
        # Constrained requests' matchers and their grammars' cache; the vocabulary is prepared
        # for them in the compile pool from now on (shard/structured_output/compiler.py).
        self.grammars = GrammarCompiler(
            detokenizer.tokenizer.to_str(), model.vocab_size, sorted(detokenizer.eos_ids),
            MaskWorker.for_device(model.device, settings.grammar_thread),
            settings.grammar_cache_bytes,
        )

    def batch_context(self) -> BatchContext:
        return BatchContext(
            device=self.model.device,
            block_size=self.block_size,
            num_blocks=self.runner.kv_cache.num_blocks,
            vocab_size=self.model.vocab_size,
            eos_ids=self.detokenizer.eos_ids,
            watermark=self.watermark,
            grammars=self.grammars,
            speculate=self.speculate,
            loaded_adapters=self.adapters.loaded(),
            image_layout=self.model.image_layout,
        )

    def info(self) -> generate_pb2.InfoResponse:
        out = info_response(
            self.model, self.settings, self.dist.world_size, self.block_size, self.encoder_decoder
        )
        a = self.adapters
        out.lora_adapters.extend(a.names)
        out.max_loras, out.max_lora_rank = a.max_loras, a.max_rank
        out.lora_runtime_updates = a.runtime_updates
        return out

    def read_adapter(self, request: generate_pb2.LoadAdapterRequest) -> HostAdapter:
        """LoadAdapter's reading, safe off the engine thread (shard/engine/adapter_verbs.py)."""
        return read_adapter(self.adapters, request)

    def load_adapter(self, request: generate_pb2.LoadAdapterRequest,
                     host: HostAdapter | None = None) -> generate_pb2.LoadAdapterResponse:
        """LoadAdapter, between steps: `host` read by read_adapter (else read here)."""
        host = host if host is not None else self.read_adapter(request)
        return install_adapter(self.adapters, self.cache.adapters(), request, host)

    def unload_adapter(self, request: generate_pb2.UnloadAdapterRequest) -> None:
        """UnloadAdapter: new requests for it are refused; its live rows finish first."""
        unload_adapter(self.adapters, self.cache.adapters(), request)

    def prepare_grammar(self, request: generate_pb2.PrepareGrammarRequest) -> Future[bool]:
        """PrepareGrammar, compiled off the engine's thread (GrammarCompiler.prepare_request)."""
        return self.grammars.prepare_request(request)

    def health(self) -> None:
        """Health: a forward into reserved block 0 (ModelRunner.health)."""
        self.runner.health()

    def prefill(self, request: generate_pb2.PrefillRequest) -> generate_pb2.PrefillResponse:
        """The newcomers' chunks and, with a cached batch, its next decode step, in one step."""
        start = time.perf_counter_ns()
        self.clock.begin(start, PREFILL if not request.HasField("cached_batch") else MIXED)
        new, encoding = new_batch(request.batch, self.batch_context(), self.model)
        place_adapters(self.adapters, new.requests, self.cache.adapters())
        cached_id = request.cached_batch.id if request.HasField("cached_batch") else None
        check_new_batch(
            new.batch_id, new.request_ids, cached_id,
            self.cache.get(cached_id).request_ids if cached_id is not None else (),
            self.cache, len(request.grants),
        )
        grants: Grants = {}
        if cached_id is not None:
            batches = [self.cache.get(cached_id)]
            grants = checked_grants(request.grants, batches, self.runner.kv_cache.num_blocks)
        try:
            cached = self.cache.pop(cached_id) if cached_id is not None else None
            step, concat_ns = self._prefill_step(new, cached, grants, encoding)
        except BaseException:
            # A failed step leaves the batches it touched in an unknown state: drop them.
            if cached_id is not None:
                self.cache.delete(cached_id)
            self.runner.lookaheads.clear()
            raise
        return reply(generate_pb2.PrefillResponse, step, start, concat_ns, self.cache, self.clock,
                     self.timeline)

    def _decode_inputs(self, batch: Batch) -> ForwardInputs:
        return decoder_inputs(batch) if self.encoder_decoder else batch.decode_inputs()

    @torch.inference_mode()
    def _prefill_step(
        self, new: Batch, cached: Batch | None, grants: Grants, encoding: Encoding | None = None
    ) -> tuple[StepResult, int | None]:
        """One forward over the cached batch's decode rows (unless its logits were computed
        ahead) and every newcomer's chunk (an encoder-decoder's: its prompt encoded, its decoder
        started); then the cached requests and the newcomers whose chunk completed their
        sequence sample, in that order. Partial chunks only write KV (and report prefill
        logprobs when asked)."""
        start = time.perf_counter_ns()
        clock = self.clock
        ahead = None
        decode = None
        if cached is not None:
            if apply_grants(cached, grants):
                self.runner.lookaheads.clear()
            ahead = self.runner.lookaheads.take(cached.request_ids)
            decode = self._decode_inputs(cached) if ahead is None else None
        inputs = prefill_inputs(new, decode, encoding)
        decoding = len(cached) if cached is not None else 0
        clock.requests = len(new) + decoding
        clock.tokens = inputs.input_ids.shape[0] + (decoding if ahead is not None else 0)
        clock.launch = time.perf_counter_ns()
        with self._span("forward"):
            logits, timer, _ = self.runner.forward(inputs)
        clock.forwarded = time.perf_counter_ns()
        prefill = prefill_tokens(new, logits, inputs, self.detokenizer)
        last = logits.index_select(0, inputs.last_rows)
        if ahead is not None:
            last = torch.cat([ahead[0], last])
        complete = [r.id for r in new.requests if r.complete]
        parts = [b for b in (cached, new.filter(complete) if complete else None) if b is not None]
        concat_ns = None
        if len(parts) > 1:
            concat_start = time.perf_counter_ns()
            with self._span("concatenate"):
                batch = Batch.concatenate(parts)
            concat_ns = time.perf_counter_ns() - concat_start
        if complete:
            resume_texts(new, self.detokenizer)
        ahead_timer = ahead[1] if ahead is not None else None
        if parts:
            step = self._sample(
                batch if len(parts) > 1 else parts[0], last, prefill, timer, start,
                also=ahead_timer,
            )
        else:
            step = no_sample(self.clock, timer, ahead_timer)
        for r in new.requests:
            if not r.complete and r.id in prefill:
                step.generations.generations.add(request_id=r.id).prefill_tokens.CopyFrom(
                    prefill[r.id]
                )
        return step, concat_ns

    def decode(self, request: generate_pb2.DecodeRequest) -> generate_pb2.DecodeResponse:
        start = time.perf_counter_ns()
        self.clock.begin(start, DECODE)
        ids = [b.id for b in request.batches]
        check_decode_batches(ids)
        grants = checked_grants(
            request.grants, [self.cache.get(i) for i in ids], self.runner.kv_cache.num_blocks
        )
        batches = self.cache.pop_all(ids)
        concat_ns = None
        if len(batches) > 1:
            with self._span("concatenate"):
                batch = Batch.concatenate(batches)
            concat_ns = time.perf_counter_ns() - start
        else:
            batch = batches[0]
        try:
            step = self._decode_step(batch, grants)
        except BaseException:
            self.runner.lookaheads.clear()
            raise
        return reply(generate_pb2.DecodeResponse, step, start, concat_ns, self.cache, self.clock,
                     self.timeline)

    @torch.inference_mode()
    def _decode_step(self, batch: Batch, grants: Grants) -> StepResult:
        """One token per request, from the logits computed ahead when there are (overlap)."""
        start = time.perf_counter_ns()
        clock = self.clock
        clock.requests = clock.tokens = len(batch)
        if apply_grants(batch, grants):
            self.runner.lookaheads.clear()
        ahead = self.runner.lookaheads.take(batch.request_ids)
        drafts = None
        if ahead is not None:
            last, timer = ahead
            clock.no_forward()
        elif self.speculate and batch.drafting and (
            drafts := step_drafts(batch, self.speculate, self.drafting_batch, self.drafter)
        ) is not None:
            return self._verify_step(batch, drafts, start)
        else:
            inputs = self._decode_inputs(batch)
            clock.launch = time.perf_counter_ns()
            with self._span("forward"):
                last, timer, _ = self.runner.forward(inputs)
            clock.forwarded = time.perf_counter_ns()
        return self._sample(batch, last, {}, timer, start, computed_ahead=ahead is not None)

    def _verify_step(self, batch: Batch, drafts: Drafts, start: int) -> StepResult:
        """A decode step whose rows carry drafts: one varlen forward over every row's last
        token and drafts (with CUDA graphs, the decode graph of its token count replays it as
        one row per token: shard/engine/verify_graphs.py), the plain choice at each row's first
        position, then the drafts kept (shard/engine/verification.py)."""
        clock = self.clock
        inputs = verify_inputs(batch, drafts)
        clock.tokens = len(batch) + drafts.count
        clock.launch = time.perf_counter_ns()
        with self._span("forward"):
            logits, timer, _ = self.runner.forward(inputs)
        clock.forwarded = time.perf_counter_ns()
        last = logits.index_select(0, inputs.last_rows)
        verifying = Verifying(logits, inputs, drafts)
        return self._sample(batch, last, {}, timer, start, verifying=verifying)

    def _sample(
        self,
        batch: Batch,
        last: torch.Tensor,
        prefill: dict[int, generate_pb2.Tokens],
        timer: ForwardTimer,
        start: int,
        computed_ahead: bool = False,
        also: ForwardTimer | None = None,
        verifying: Verifying | None = None,
    ) -> StepResult:
        """Next tokens from `last` (a logits row per request of `batch`); with overlap, the next
        decode forward is queued before the host reads this step's tokens back. `also`: the
        look-ahead forward a mixed step took its decode rows' logits from (its device time).
        `verifying`: the step's logits at every position, its inputs and drafts (a verification
        step: the drafting rows may emit more tokens after their first)."""
        clock = self.clock
        with self._span("sample"):
            choice = choose_tokens(batch, last, prefill)
            clock.chosen = time.perf_counter_ns()
            if self.overlap and (not self.speculate or len(batch) > self.drafting_batch):
                self._look_ahead(batch)
            clock.ahead = time.perf_counter_ns()
            # The step's one wait on the device, timed apart from the host work after it.
            choice.transfer.settle()
            clock.synced = time.perf_counter_ns()
            generations, finished = emit_generations(batch, choice, self.detokenizer, self.writer)
            if verifying is not None:
                finished = kept_tokens(batch, generations, finished, verifying, self.detokenizer)
            live: Batch | None = batch
            if finished:
                done = set(finished)
                keep = [i for i in batch.request_ids if i not in done]
                live = batch.filter(keep) if keep else None
                if live is None and self.overlap:
                    self.runner.lookaheads.drop(done)
        # The forward's own time (on CUDA: on the device, read without another sync) and the
        # rest; a forward computed ahead overlapped the previous call, so all of this one's
        # time is the rest.
        clock.emitted = time.perf_counter_ns()
        step_ns, forward_ns = clock.emitted - start, timer.elapsed_ns()
        clock.device_ns = forward_ns + (also.elapsed_ns() if also is not None else 0)
        decode_ns = step_ns if computed_ahead else max(step_ns - forward_ns, 0)
        return StepResult(generations, live, forward_ns, decode_ns)

    def _look_ahead(self, batch: Batch) -> None:
        """Queues the next decode forward of every request of `batch` (shard/engine/lookahead.py)."""
        with self._span("lookahead"):
            self.runner.look_ahead(batch)

    def filter(self, batch_id: int, request_ids: list[int]) -> generate_pb2.CachedBatch | None:
        """Keeps the listed requests; None when none is left (the batch is dropped)."""
        batch = self.cache.pop(batch_id)
        try:
            with self._span("filter"):
                kept = batch.filter(request_ids)
        except InvalidRequest:
            self.cache.set(batch)
            raise
        self.cache.set(kept)
        return kept.to_pb() if len(kept) else None

    def clear(self, batch_id: int | None) -> None:
        if batch_id is None:
            self.cache.clear()
            self.runner.lookaheads.clear()
        else:
            self.cache.delete(batch_id)

    def warmup(self, request: generate_pb2.WarmupRequest) -> generate_pb2.WarmupResponse:
        """Warmup: the prefill budget measured when the router left it to the shard
        (shard/engine/prefill_ladder.py); the runner sizes the KV cache from the peak of the
        largest prefill (and a decode) run through this engine's own Prefill and Decode
        (_run_warmup_batch), allocates it, and captures the decode graphs over it."""
        # Warmup replaces the cache the look-aheads wrote into; its steps stay off the timeline.
        self.runner.lookaheads.clear()
        timeline, self.timeline = self.timeline, None
        try:
            limits = warmup_limits(request, self.model, len(self.cache))
            self.cache.clear()
            chunking = not self.encoder_decoder
            limits, prefill_sizing = resolve_prefill(
                self.runner, limits, self._run_warmup_batch, chunking
            )
            size = self.runner.size_kv_cache(limits, self._run_warmup_batch)
            self.runner.allocate_sized(size)
            response = warmup_response(
                limits, self.model, size.num_blocks, self.block_size, chunking
            )
            response.prefill_sizing = prefill_sizing
            if size.graph_buckets:
                self.runner.capture_graphs(size, response.max_total_tokens)
            return response
        finally:
            self.runner.lookaheads.clear()
            self.timeline = timeline

    def _run_warmup_batch(self, batch: generate_pb2.Batch) -> None:
        """Warmup's batch through Prefill and, while requests remain, one Decode; the batch
        cache is left empty (ModelRunner.size_kv_cache measures the device around this)."""
        try:
            response = self.prefill(generate_pb2.PrefillRequest(batch=batch))
            if response.HasField("batch"):
                self.decode(generate_pb2.DecodeRequest(batches=[response.batch]))
        finally:
            self.cache.clear()

    def _span(self, name: str) -> AbstractContextManager[trace.Span | None]:
        """A span of the engine's tracer; none while tracing is off (no tracer provider was
        installed): no-op spans still cost ~20 us each in a decode step's bookkeeping."""
        if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            return nullcontext()
        return self.tracer.start_as_current_span(name)

