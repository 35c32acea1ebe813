"""The router's side of the live requests: which are in the shards' batch, which are mid-prefill,
what KV they hold, and turning each step's `Generation`s into their streams' events.

Hot path: `apply_step` runs once per Prefill/Decode for every live request. It routes by one dict
lookup per generation, builds events straight from the protobuf lists, reads the clock once, and
touches the prefix cache only when a sequence's KV completes a block.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from pytgi_proto import generate_pb2
from pytgi_router.core.errors import GenerationError, InferError
from pytgi_router.core.prefix_cache import PrefixCache
from pytgi_router.core.request import Entry, EntryState
from pytgi_router.core.request_stream import End, Prefill, RequestStream, Token, TokenInfo
from pytgi_router.core.step_plan import Chunk

FINISH_REASONS = ("length", "eos_token", "stop_sequence")
logger = logging.getLogger(__name__)
NAN = float("nan")


def token_infos(tokens: generate_pb2.Tokens) -> list[TokenInfo]:
    ids = tokens.ids
    texts, logprobs, special = tokens.texts, tokens.logprobs, tokens.is_special
    n = len(ids)
    if len(texts) == n and len(logprobs) == n and len(special) == n:
        return [TokenInfo(*t) for t in zip(ids, texts, logprobs, special, strict=True)]
    # A shard may leave optional lists empty: fill in neutral values rather than fail a batch.
    return [
        TokenInfo(
            ids[i],
            texts[i] if i < len(texts) else "",
            logprobs[i] if i < len(logprobs) else NAN,
            special[i] if i < len(special) else False,
        )
        for i in range(n)
    ]


def route_generation(entry: Entry, generation: generate_pb2.Generation, now: float) -> bool:
    """Pushes one step's events for `entry` and appends its new tokens to its sequence; True
    when this generation finished it."""
    stream = entry.stream
    request = entry.request
    # Each protobuf field access costs a wrapper object: read only what the request can carry.
    if request.sampling.grammar_type and generation.HasField("error"):
        _fail(entry, generation.error)
        return True
    if request.prefill_logprobs and not entry.prefill_sent:
        _push_prefill(entry, generation)
    tokens = generation.tokens
    ids = tokens.ids
    finished = generation.HasField("generated_text")
    if len(ids) == 1 and not request.top_n_tokens:
        # The common step: one token, no alternatives.
        token_id = ids[0]
        entry.tokens.append(token_id)
        try:
            info = TokenInfo(token_id, tokens.texts[0], tokens.logprobs[0], tokens.is_special[0])
        except IndexError:
            info = token_infos(tokens)[0]
        if finished:
            stream.push(_end(entry, info, [], generation.generated_text, now))
        else:
            stream.push(Token(info, []))
        return finished
    infos = token_infos(tokens)
    entry.tokens.extend(ids)
    top = generation.top_tokens
    last = len(infos) - 1 if finished else len(infos)
    for i, info in enumerate(infos):
        # Never more than asked, whatever a shard sends (a tie must not list the vocabulary).
        top_i = token_infos(top[i])[: request.top_n_tokens] if i < len(top) else []
        if i == last:
            stream.push(_end(entry, info, top_i, generation.generated_text, now))
        else:
            stream.push(Token(info, top_i))
    if finished and not infos:
        # Finished without a token this step: still end the stream with the final text.
        stream.push(_end(entry, TokenInfo(0, "", NAN, True), [], generation.generated_text, now))
    return finished


def _fail(entry: Entry, reason: str) -> None:
    """The shard failed the request this step (only a constrained one can: its grammar's
    matcher failed) and dropped it from its batch: its stream ends with a generation error
    (TGI's 424), its tokens of this step unsent."""
    logger.warning("request %d failed during generation: %s", entry.id, reason)
    entry.stream.fail(GenerationError(reason))


def _push_prefill(entry: Entry, generation: generate_pb2.Generation) -> None:
    """The one Prefill event: the prompt logprobs of every chunk, with the completing one's."""
    infos = entry.prefill_infos
    if generation.HasField("prefill_tokens"):
        infos.extend(token_infos(generation.prefill_tokens))
    entry.stream.push(Prefill(infos))
    entry.prefill_infos = []
    entry.prefill_sent = True


def _end(
    entry: Entry,
    info: TokenInfo,
    top: list[TokenInfo],
    text: generate_pb2.GeneratedText,
    now: float,
) -> End:
    reason = text.finish_reason
    return End(
        info,
        top,
        generated_text=text.text,
        finish_reason=FINISH_REASONS[reason] if 0 <= reason < len(FINISH_REASONS) else "length",
        generated_tokens=text.generated_tokens,
        seed=text.seed if text.HasField("seed") else None,
        queued_at=entry.queued_at,
        started_at=entry.started_at,
        finished_at=now,
    )



class RunningBatch:
    """The live entries and the KV blocks they hold: `entries` are in the batch cached on the
    shards (or join it with the step in flight), `prefilling` were admitted with a prompt not yet
    complete (the shards keep no state for them: each step sends their next chunk).

    Blocks are released only here, between steps, never while a step may still write them: a
    cancelled request's blocks stay held until it has left the shards' batch.
    """

    def __init__(self, cache: PrefixCache, release: Callable[[Entry], None]) -> None:
        self.cache = cache
        # Called once per entry that leaves for good (finished, failed, lost or cancelled).
        self._release = release
        self.entries: dict[int, Entry] = {}
        self.prefilling: dict[int, Entry] = {}
        self.cached: generate_pb2.CachedBatch | None = None
        self._cancelled: set[int] = set()

    def __len__(self) -> int:
        return len(self.entries) + len(self.prefilling)

    @property
    def cancelling(self) -> bool:
        """Whether a live request was cancelled and leaves after the next step."""
        return bool(self._cancelled)

    @property
    def reserved_tokens(self) -> int:
        """KV tokens the live entries hold (whole blocks, cached prefixes they use included)."""
        return self.cache.used_count * self.cache.block_size

    def start(self, chunks: Iterable[Chunk]) -> None:
        """Before a step: the chunks' entries are live; those whose chunk completes their
        sequence join the shards' batch with it (a failed step fails them with it)."""
        for chunk in chunks:
            entry = chunk.entry
            if chunk.completes:
                self.prefilling.pop(entry.id, None)
                self.entries[entry.id] = entry
                entry.state = EntryState.RUNNING
            else:
                self.prefilling[entry.id] = entry
                entry.state = EntryState.PREFILLING

    def mark_cancelled(self, entry_id: int) -> None:
        """From a client's cancel(): the entry leaves at the end of the current step."""
        if entry_id in self.entries or entry_id in self.prefilling:
            self._cancelled.add(entry_id)

    def drop_cancelled_prefills(self) -> None:
        """Between steps: cancelled entries mid-prefill are in no shard batch, so they leave now
        (their blocks with them) rather than be sent another chunk."""
        for entry in [e for e in self.prefilling.values() if e.stream.cancelled]:
            self._cancelled.discard(entry.id)
            self._retire(entry)

    def preempt(self, entry: Entry) -> bool:
        """Takes `entry` out of the live set (the planner released its blocks; the caller
        filters it out of the shards' batch). True: it waits again, its stream open, to resume
        with every token it has, none streamed twice. False: it was cancelled, and has left."""
        self.entries.pop(entry.id, None)
        self.prefilling.pop(entry.id, None)
        entry.blocks_held = entry.blocks_sent = 0
        if entry.id in self._cancelled or entry.stream.cancelled:
            self._cancelled.discard(entry.id)
            self._release(entry)
            return False
        pb = entry.pb
        generated = entry.generated
        if generated:
            # The shards go on after these; the Prefill event (if asked) already went out.
            pb.generated_ids[:] = generated
            pb.prefill_logprobs = False
        entry.prefill_infos = []
        entry.computed = 0
        entry.state = EntryState.WAITING
        return True

    def apply_step(
        self,
        generations: Iterable[generate_pb2.Generation],
        cached: generate_pb2.CachedBatch | None,
    ) -> list[int] | None:
        """Routes a step's generations, commits newly written KV blocks to the prefix cache and
        retires finished and cancelled entries.

        Returns the request ids the shards must keep when their batch has to be filtered (an
        empty list: drop the whole batch), None when the shards' batch is already right.
        """
        entries = self.entries
        prefilling = self.prefilling
        cache = self.cache
        size = cache.block_size
        caching = cache.prefix_caching
        now = time.monotonic()
        for generation in generations:
            entry = entries.get(generation.request_id)
            if entry is None:
                partial = prefilling.get(generation.request_id)
                if partial is not None and generation.HasField("prefill_tokens"):
                    partial.prefill_infos.extend(token_infos(generation.prefill_tokens))
                continue
            finished = route_generation(entry, generation, now)
            # Every known token but the one just sampled now has its KV written.
            computed = len(entry.tokens) - 1
            if computed > entry.computed:
                if caching and computed // size > entry.computed // size:
                    cache.commit(entry.id, entry.key_tokens[:computed])
                entry.computed = computed
            if finished:
                self._retire(entry)
        if self._cancelled:
            for entry_id in self._cancelled:
                entry = entries.get(entry_id) or prefilling.get(entry_id)
                if entry is not None:
                    self._retire(entry)
            self._cancelled.clear()
        self.cached = cached
        if cached is None:
            # The shards dropped the batch: whoever is still in it will never get an End.
            self._close_all(None, list(entries.values()))
            return None
        return self._kept_ids(cached)

    def chunks_written(self, chunks: Iterable[Chunk]) -> None:
        """After a successful step: the partial chunks' KV is in their blocks (the completing
        ones advanced with their first token in apply_step)."""
        cache = self.cache
        size = cache.block_size
        for chunk in chunks:
            entry = chunk.entry
            if chunk.completes or entry.id not in self.prefilling:
                continue
            if cache.prefix_caching and chunk.end // size > entry.computed // size:
                cache.commit(entry.id, entry.key_tokens[:chunk.end])
            entry.computed = chunk.end

    def _kept_ids(self, cached: generate_pb2.CachedBatch) -> list[int] | None:
        entries = self.entries
        ids = cached.request_ids
        if len(ids) == len(entries) and all(i in entries for i in ids):
            return None
        kept = [i for i in ids if i in entries]
        if len(kept) < len(entries):
            present = set(kept)
            for lost in [e for i, e in entries.items() if i not in present]:
                lost.stream.close_incomplete()
                self._retire(lost)
        return kept

    def drop_batch(self) -> None:
        """The shards no longer hold the batch: its requests will never get their End."""
        self._close_all(None, list(self.entries.values()))
        self.cached = None
        self._cancelled.intersection_update(self.prefilling)

    def fail_entries(self, entries: Iterable[Entry], error: InferError) -> None:
        """Only `entries` end with `error` (a prefill the shards refused as invalid): the
        cached batch and its requests are untouched."""
        for entry in entries:
            if entry.id in self.entries or entry.id in self.prefilling:
                self._cancelled.discard(entry.id)
                entry.stream.fail(error)
                self._retire(entry)

    def fail_all(self, error: InferError) -> None:
        """The step is lost (shard failure): every live request ends with `error`."""
        self._close_all(error, [*self.entries.values(), *self.prefilling.values()])
        self.cached = None
        self._cancelled.clear()

    def _close_all(self, error: InferError | None, entries: list[Entry]) -> None:
        for entry in entries:
            stream: RequestStream = entry.stream
            if error is None:
                stream.close_incomplete()
            else:
                stream.fail(error)
            self._retire(entry)

    def _retire(self, entry: Entry) -> None:
        if self.entries.pop(entry.id, None) is None and self.prefilling.pop(entry.id, None) is None:
            return
        if entry.id in self.cache:
            self.cache.release(entry.id)
        entry.blocks_held = entry.blocks_sent = 0
        self._release(entry)
