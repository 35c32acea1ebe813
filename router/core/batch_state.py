"""The router's side of the running batch: which requests are live, what they hold, and turning
each step's `Generation`s into their streams' events.

Hot path: `apply_step` runs once per Prefill/Decode for every live request. It routes by one dict
lookup per generation, builds events straight from the protobuf lists, and reads the clock once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from pytgi_proto import generate_pb2
from pytgi_router.core.block_allocator import BlockAllocator
from pytgi_router.core.errors import InferError
from pytgi_router.core.request import Entry, ValidRequest
from pytgi_router.core.request_stream import End, Prefill, RequestStream, Token, TokenInfo

FINISH_REASONS = ("length", "eos_token", "stop_sequence")
NAN = float("nan")


def build_batch(batch_id: int, entries: list[Entry], block_size: int) -> generate_pb2.Batch:
    """The Prefill message for newly admitted entries (each already holds its blocks)."""
    requests = []
    max_blocks = 0
    total_blocks = 0
    for entry in entries:
        blocks = entry.blocks or []
        entry.pb.blocks[:] = blocks
        requests.append(entry.pb)
        max_blocks = max(max_blocks, len(blocks))
        total_blocks += len(blocks)
    return generate_pb2.Batch(
        id=batch_id,
        requests=requests,
        size=len(requests),
        max_tokens=total_blocks * block_size,
        max_blocks=max_blocks,
    )


def request_pb(entry_id: int, request: ValidRequest) -> generate_pb2.Request:
    """The request's wire form, built once at submission (blocks are filled in at admission).

    Raises ValueError for a value the wire cannot carry (e.g. a seed beyond 64 bits).
    """
    sampling = request.sampling
    stopping = request.stopping
    return generate_pb2.Request(
        id=entry_id,
        inputs=request.inputs,
        truncate=request.truncate,
        parameters=generate_pb2.NextTokenChooserParameters(
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            typical_p=sampling.typical_p,
            do_sample=sampling.do_sample,
            seed=sampling.seed,
            repetition_penalty=sampling.repetition_penalty,
            frequency_penalty=sampling.frequency_penalty,
            watermark=sampling.watermark,
            grammar=sampling.grammar,
            grammar_type=sampling.grammar_type,  # type: ignore[arg-type]
        ),
        stopping_parameters=generate_pb2.StoppingCriteriaParameters(
            max_new_tokens=stopping.max_new_tokens,
            stop_sequences=stopping.stop_sequences,
            ignore_eos_token=stopping.ignore_eos_token,
        ),
        prefill_logprobs=request.prefill_logprobs,
        top_n_tokens=request.top_n_tokens,
        input_ids=request.input_ids,
        add_special_tokens=request.add_special_tokens,
    )


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
    """Pushes one step's events for `entry`; True when this generation finished it."""
    stream = entry.stream
    request = entry.request
    # Each protobuf field access costs a wrapper object: read only what the request can carry.
    if request.prefill_logprobs and generation.HasField("prefill_tokens"):
        stream.push(Prefill(token_infos(generation.prefill_tokens)))
    tokens = generation.tokens
    ids = tokens.ids
    finished = generation.HasField("generated_text")
    if len(ids) == 1 and not request.top_n_tokens:
        # The common step: one token, no alternatives.
        try:
            info = TokenInfo(ids[0], tokens.texts[0], tokens.logprobs[0], tokens.is_special[0])
        except IndexError:
            info = token_infos(tokens)[0]
        if finished:
            stream.push(_end(entry, info, [], generation.generated_text, now))
        else:
            stream.push(Token(info, []))
        return finished
    infos = token_infos(tokens)
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
    """Live entries of the batch cached on the shards, and the blocks they hold.

    Blocks are freed only here, at the end of a step, before the batching task can admit anyone
    new: a cancelled request's blocks stay reserved until it has left the shards' batch.
    """

    def __init__(self, allocator: BlockAllocator, release: Callable[[Entry], None]) -> None:
        self.allocator = allocator
        # Called once per entry that leaves for good (finished, failed, lost or cancelled).
        self._release = release
        self.entries: dict[int, Entry] = {}
        self.cached: generate_pb2.CachedBatch | None = None
        self._cancelled: set[int] = set()
        self._blocks = 0

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def reserved_tokens(self) -> int:
        """KV tokens the live entries hold (whole blocks)."""
        return self._blocks * self.allocator.block_size

    def add(self, entries: Iterable[Entry]) -> None:
        for entry in entries:
            self.entries[entry.id] = entry
            self._blocks += len(entry.blocks or ())

    def mark_cancelled(self, entry_id: int) -> None:
        """From a client's cancel(): the entry leaves at the end of the current step."""
        if entry_id in self.entries:
            self._cancelled.add(entry_id)

    def apply_step(
        self,
        generations: Iterable[generate_pb2.Generation],
        cached: generate_pb2.CachedBatch | None,
    ) -> list[int] | None:
        """Routes a step's generations and retires finished and cancelled entries.

        Returns the request ids the shards must keep when their batch has to be filtered (an
        empty list: drop the whole batch), None when the shards' batch is already right.
        """
        entries = self.entries
        now = time.monotonic()
        for generation in generations:
            entry = entries.get(generation.request_id)
            if entry is not None and route_generation(entry, generation, now):
                self._retire(entry)
        if self._cancelled:
            for entry_id in self._cancelled:
                entry = entries.get(entry_id)
                if entry is not None:
                    self._retire(entry)
            self._cancelled.clear()
        self.cached = cached
        if cached is None:
            # The shards dropped the batch: whoever is still live will never get an End.
            self._close_all(None)
            return None
        return self._kept_ids(cached)

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
        """The shards no longer hold the batch: live requests will never get their End."""
        self._close_all(None)
        self.cached = None
        self._cancelled.clear()

    def fail_entries(self, entries: Iterable[Entry], error: InferError) -> None:
        """Only `entries` end with `error` (a prefill the shards refused as invalid): the
        cached batch and its requests are untouched."""
        for entry in entries:
            if entry.id in self.entries:
                self._cancelled.discard(entry.id)
                entry.stream.fail(error)
                self._retire(entry)

    def fail_all(self, error: InferError) -> None:
        """The batch is lost (shard failure): every live request ends with `error`."""
        self._close_all(error)
        self.cached = None
        self._cancelled.clear()

    def _close_all(self, error: InferError | None) -> None:
        for entry in list(self.entries.values()):
            stream: RequestStream = entry.stream
            if error is None:
                stream.close_incomplete()
            else:
                stream.fail(error)
            self._retire(entry)

    def _retire(self, entry: Entry) -> None:
        if self.entries.pop(entry.id, None) is None:
            return
        if entry.blocks is not None:
            self._blocks -= len(entry.blocks)
            self.allocator.free(entry.blocks)
            entry.blocks = None
        self._release(entry)
