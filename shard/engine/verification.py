"""A decode step that carries drafts (--speculate): its forward's inputs, the verification of the
drafts against the target's logits, and the Generations' further tokens.

The forward: every row feeds its last token and its drafts (none for most rows) at their true
positions, through the paged cache, as one varlen step (the path chunked prefill takes: a row's
tokens attend to its cached KV and causally to each other), with logits at every position. The
drafts' KV lands in the slots after the row's known tokens (the router holds them: step_plan's
kv_tokens); the slots of rejected drafts are overwritten by later steps.

The step's first token of every row is chosen from its first position exactly as a plain step
chooses it (the engine's choose_tokens and emit_generations, which also decide its stops); a
drafting row is greedy on the raw logits (shard/engine/drafting.py), so that token is the
argmax there, and `verify_greedy` keeps the drafts while each is the argmax after its
predecessor. The kept drafts after the first token and the target's token after them are this
module's: appended to the row's Generation one at a time with their logprobs (and top tokens),
each checked for length, EOS and stop sequences as a plain step would, and the row stops at the
first that ends it (the tokens after it are dropped).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pytgi_proto import generate_pb2
from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.engine.batch import Batch
from pytgi_shard.engine.drafter import Drafter, NgramDrafter
from pytgi_shard.engine.drafting import DRAFTING_BATCH, STEP_TOKENS, Drafts, plan_asks
from pytgi_shard.engine.request_state import RequestState
from pytgi_shard.engine.step_inputs import ForwardInputs
from pytgi_shard.output.detokenizer import Detokenizer, TextStreams
from pytgi_shard.output.stopping import EOS_TOKEN, LENGTH, STOP_SEQUENCE
from pytgi_shard.sample.chooser import top_tokens
from pytgi_shard.speculative.acceptance import verify_greedy


def step_drafts(
    batch: Batch, speculate: int, drafting_batch: int = DRAFTING_BATCH,
    drafter: Drafter | None = None,
) -> Drafts | None:
    """The decode step's drafts: the rows that may draft and how many (drafting.plan_asks),
    within the KV slots each row holds, proposed by `drafter` (shard/engine/drafter.py; None:
    the n-gram index); None (at once, for a batch too large to draft) when no row drafts."""
    if len(batch) > drafting_batch or len(batch) >= STEP_TOKENS:
        return None
    requests = batch.requests
    states = [r.draft for r in requests]
    left = [r.stopping.max_new_tokens - r.text.generated for r in requests]
    asks = plan_asks(states, batch.room(), left, speculate, drafting_batch)
    if not asks:
        return None
    return (drafter or NGRAM).propose(batch, asks)


# The drafter of --speculate alone.
NGRAM = NgramDrafter()


@dataclass(frozen=True, slots=True)
class Verifying:
    """A verification step's forward: logits at every position, its inputs and drafts."""

    logits: torch.Tensor
    inputs: ForwardInputs
    drafts: Drafts


def kept_tokens(
    batch: Batch,
    response: generate_pb2.DecodeResponse,
    finished: list[int],
    verifying: Verifying,
    detokenizer: Detokenizer,
) -> list[int]:
    """After the step's first tokens are emitted: the drafts verified, the kept ones emitted
    (emit_kept) and appended to the batch, the step's draft counts in its answer; the finished
    request ids."""
    drafts = verifying.drafts
    verified = verify(verifying.logits, verifying.inputs, drafts, batch)
    finished, rows, extra = emit_kept(batch, response, finished, drafts, verified, detokenizer)
    batch.append_extra(rows, extra)
    response.drafted_tokens = drafts.count
    response.drafted_rows = len(drafts.rows)
    return finished


def verify_inputs(batch: Batch, drafts: Drafts) -> ForwardInputs:
    """The step's flat inputs: per row its last token then its drafts, logits everywhere;
    `last_rows` are each row's first position (what a plain step's logits would be)."""
    device = batch.lengths.device
    n = len(batch)
    counts = [1] * n
    for row, tokens in zip(drafts.rows, drafts.tokens, strict=True):
        counts[row] += len(tokens)
    total = sum(counts)
    q_lens = torch.tensor(counts, dtype=torch.long, device=device)
    cu = torch.nn.functional.pad(torch.cumsum(q_lens, 0), (1, 0))
    row_of_token = torch.repeat_interleave(batch.rows, q_lens, output_size=total)
    offsets = torch.arange(total, device=device) - cu[:-1][row_of_token]
    positions = (batch.lengths - 1)[row_of_token] + offsets
    input_ids = batch.last_ids[row_of_token]
    where = [int(start) + 1 + j for start, tokens in zip(
        _starts(counts, drafts.rows), drafts.tokens, strict=True) for j in range(len(tokens))]
    input_ids[torch.tensor(where, dtype=torch.long, device=device)] = torch.tensor(
        [t for tokens in drafts.tokens for t in tokens], dtype=torch.long, device=device
    )
    longest = max(
        batch.requests[row].length + len(tokens)
        for row, tokens in zip(drafts.rows, drafts.tokens, strict=True)
    )
    meta = AttentionMetadata(
        is_prefill=True,
        cu_seqlens_q=cu.to(torch.int32),
        seqlens_k=(batch.lengths + q_lens - 1).to(torch.int32),
        slot_mapping=batch.slot_table[row_of_token, positions],
        block_tables=batch.block_tables,
        max_seqlen_q=max(counts),
        max_seqlen_k=max(batch.max_length, longest),
        block_size=batch.block_size,
    )
    per_row = batch.row_adapters()
    adapters = None if per_row is None else per_row[row_of_token]
    return ForwardInputs(input_ids, positions, meta, None, cu[:-1], adapters=adapters)


def _starts(counts: list[int], rows: list[int]) -> list[int]:
    """The flat index of each listed row's first token."""
    starts, at = [], 0
    wanted = iter(rows)
    target = next(wanted, None)
    for row, count in enumerate(counts):
        if row == target:
            starts.append(at)
            target = next(wanted, None)
        at += count
    return starts


@dataclass(frozen=True, slots=True)
class Verified:
    """Per drafting row (Drafts.rows' order): drafts kept, the emitted tokens (the first is
    the step's plain token), their logprobs, and their top tokens when the row asked."""

    accepted: list[int]
    tokens: list[list[int]]
    logprobs: list[list[float]]
    tops: list[list[tuple[list[int], list[float]]]] | None


def verify(logits: torch.Tensor, inputs: ForwardInputs, drafts: Drafts, batch: Batch) -> Verified:
    """`verify_greedy` over the drafting rows' positions of `logits` ([tokens, vocab], the raw
    scores: a drafting row's chooser is the identity), read back to the host in one transfer."""
    device = logits.device
    lengths = [len(t) for t in drafts.tokens]
    k = max(lengths)
    rows = torch.tensor(drafts.rows, dtype=torch.long, device=device)
    length_t = torch.tensor(lengths, dtype=torch.long, device=device)
    steps = torch.minimum(torch.arange(k + 1, device=device).unsqueeze(0), length_t.unsqueeze(1))
    flat = inputs.last_rows[rows].unsqueeze(1) + steps
    scores = logits[flat]
    padded = torch.tensor(
        [t + [-1] * (k - len(t)) for t in drafts.tokens], dtype=torch.long, device=device
    )
    verdict = verify_greedy(scores, padded, length_t)
    logprobs = torch.log_softmax(scores, dim=-1)
    chosen = logprobs.gather(2, verdict.tokens.clamp(min=0).unsqueeze(2)).squeeze(2)
    packed = torch.cat(
        [verdict.accepted.double().unsqueeze(1), verdict.tokens.double(), chosen.double()], dim=1
    ).tolist()
    accepted = [int(p[0]) for p in packed]
    tokens = [[int(t) for t in p[1 : 2 + a]] for p, a in zip(packed, accepted, strict=True)]
    lps = [p[2 + k : 3 + k + a] for p, a in zip(packed, accepted, strict=True)]
    tops = None
    if batch.top_n is not None:
        wanted = [batch.requests[row].top_n_tokens for row in drafts.rows]
        flat_tops = top_tokens(logprobs.flatten(0, 1), [n for n in wanted for _ in range(k + 1)])
        tops = [flat_tops[i * (k + 1) : i * (k + 1) + a + 1] for i, a in enumerate(accepted)]
    return Verified(accepted, tokens, lps, tops)


def emit_kept(
    batch: Batch,
    response: generate_pb2.DecodeResponse,
    finished: list[int],
    drafts: Drafts,
    verified: Verified,
    detokenizer: Detokenizer,
) -> tuple[list[int], list[int], list[list[int]]]:
    """Appends each drafting row's tokens after its first (emitted by the plain path) to its
    Generation, stopping where a plain run would; records each proposal's outcome for the
    drafter's back-off. Returns the finished request ids (`finished` and the rows stopped
    here), and the rows that go on with the tokens appended to them."""
    requests = batch.requests
    done = set(finished)
    special = detokenizer.special_ids
    generations = response.generations
    rows: list[int] = []
    extra: list[list[int]] = []
    for i, row in enumerate(drafts.rows):
        r = requests[row]
        if r.draft is not None:
            r.draft.record(len(drafts.tokens[i]), verified.accepted[i])
        if r.id in done or not verified.accepted[i]:
            continue
        g = generations[row]
        stream = TextStreams([batch.streams.streams[row]])
        emitted: list[int] = []
        for j in range(1, verified.accepted[i] + 1):
            token = verified.tokens[i][j]
            text = detokenizer.advance(stream, [token])[0]
            emitted.append(token)
            g.tokens.ids.append(token)
            g.tokens.logprobs.append(verified.logprobs[i][j])
            g.tokens.texts.append(text)
            g.tokens.is_special.append(token in special)
            if verified.tops is not None and r.top_n_tokens:
                _add_top(g.top_tokens.add(), verified.tops[i][j], detokenizer)
            reason = _stop(r, token, text)
            if reason is not None:
                _finish(g.generated_text, r, reason, detokenizer)
                finished.append(r.id)
                break
        else:
            rows.append(row)
            extra.append(emitted)
    # Streams advanced one at a time here: the batch's next step finds its windowed rows anew.
    batch.streams.windowed = None
    return finished, rows, extra


def _stop(r: RequestState, token: int, text: str) -> int | None:
    """StoppingCriteria's order for a token already counted in the request's text: length,
    EOS, stop sequences."""
    stopping = r.stopping
    if r.text.generated >= stopping.max_new_tokens:
        return LENGTH
    if token in stopping.eos_ids:
        return EOS_TOKEN
    if stopping.stop_sequences and stopping.matches(text):
        return STOP_SEQUENCE
    return None


def _finish(
    out: generate_pb2.GeneratedText, r: RequestState, reason: int, detokenizer: Detokenizer
) -> None:
    out.text = detokenizer.decode(r.text.generated_ids, skip_special_tokens=True)
    out.generated_tokens = r.text.generated
    out.finish_reason = reason  # type: ignore[assignment]


def _add_top(
    out: generate_pb2.Tokens, top: tuple[list[int], list[float]], detokenizer: Detokenizer
) -> None:
    ids, lps = top
    out.ids.extend(ids)
    out.logprobs.extend(lps)
    out.texts.extend(detokenizer.token_texts(ids))
    out.is_special.extend(i in detokenizer.special_ids for i in ids)
