"""A decode step that carries drafts (--speculate): its forward's inputs, the verification of the
drafts against the target's logits, and the Generations' further tokens.

The forward: every row feeds its last token and its drafts (none for most rows) at their true
positions, through the paged cache, as one varlen step (the path chunked prefill takes: a row's
tokens attend to its cached KV and causally to each other), with logits at every position. The
drafts' KV lands in the slots after the row's known tokens (the router holds them: step_plan's
kv_tokens); the slots of rejected drafts are overwritten by later steps.

The step's first token of every row is chosen from its first position exactly as a plain step
chooses it (the engine's choose_tokens and emit_generations, which also decide its stops and
feed its grammar). Each drafting row's later positions are then chosen the same way
(shard/engine/draft_positions.py: its parameters, penalties over the drafts before the position,
its grammar's mask after them, a sampling row's draws of that token's index), and
`kept_count` keeps the drafts while each equals the token chosen at its position. The
kept drafts after the first token and the token chosen after them are this module's: appended
to the row's Generation one at a time with their logprobs (and top tokens), each checked for
length, EOS and stop sequences as a plain step would, and the row stops at the first that ends it
(the tokens after it are dropped). So every row's tokens are those of its plain run: a greedy
row's exactly, a seeded sampling row's too (its i-th token draws the same numbers either way:
shard/sample/token_draws.py), and an unseeded one's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pytgi_proto import generate_pb2
from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.engine.batch import Batch
from pytgi_shard.engine.draft_positions import (
    drafted_banned,
    drafted_history,
    drafted_positions,
    position_chooser,
)
from pytgi_shard.engine.drafter import Drafter, NgramDrafter
from pytgi_shard.engine.drafting import DRAFTING_BATCH, STEP_TOKENS, Drafts, plan_asks
from pytgi_shard.engine.generation import set_generated_text
from pytgi_shard.engine.request_state import RequestState
from pytgi_shard.engine.step_inputs import ForwardInputs
from pytgi_shard.output.detokenizer import Detokenizer, TextStreams
from pytgi_shard.output.stopping import EOS_TOKEN, LENGTH, STOP_SEQUENCE
from pytgi_shard.sample.chooser import top_tokens
from pytgi_shard.speculative.acceptance import kept_count


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
    # The sampling rows' next draws follow the tokens emitted; the grammars consume them.
    counts = [0] * len(batch)
    for row, tokens in zip(rows, extra, strict=True):
        counts[row] = len(tokens)
    batch.chooser.skip_draws(counts)
    if batch.grammar is not None:
        batch.grammar.advance_kept(dict(zip(rows, extra, strict=True)))
    response.drafted_tokens = drafts.count
    response.drafted_rows = len(drafts.rows)
    return finished


def verify_inputs(batch: Batch, drafts: Drafts) -> ForwardInputs:
    """The step's flat inputs: per row its last token then its drafts, logits everywhere;
    `last_rows` are each row's first position (what a plain step's logits would be). The
    model's positions of a row with images carry its M-RoPE shift; its KV slots do not."""
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
    # A request with images (M-RoPE): every token after its prompt sits at its sequence index
    # plus the rope delta, as a plain decode step places it (Batch.position_shift).
    shift = batch.position_shift
    rope_positions = positions if shift is None else positions + shift[row_of_token]
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
    return ForwardInputs(input_ids, rope_positions, meta, None, cu[:-1], adapters=adapters)


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
    """Per drafting row (Drafts.rows' order): drafts kept, and the tokens the step emits after
    its plain first one (the kept drafts after the first, then the token chosen after the last
    kept one: `accepted` of them), their logprobs, and their top tokens when the row asked."""

    accepted: list[int]
    tokens: list[list[int]]
    logprobs: list[list[float]]
    tops: list[list[tuple[list[int], list[float]]]] | None


def verify(logits: torch.Tensor, inputs: ForwardInputs, drafts: Drafts, batch: Batch) -> Verified:
    """Each drafting row's positions after its first chosen as the plain step would choose
    them (shard/engine/draft_positions.py), read back to the host in one transfer with the
    step's plain tokens, and the drafts kept while they equal those choices (`kept_count`).
    Runs after the step's plain tokens were chosen, appended and (their grammar) advanced.
    A drafting batch is small (drafting.DRAFTING_BATCH): the bookkeeping is the host's."""
    device = logits.device
    rows = torch.tensor(drafts.rows, dtype=torch.long, device=device)
    positions = drafted_positions(drafts, device)
    scores = logits[inputs.last_rows[positions.batch_row] + positions.step]
    first = batch.last_ids.index_select(0, rows)
    banned = None
    if batch.grammar is not None:
        banned = drafted_banned(batch, drafts, positions, first.tolist())
    chooser = position_chooser(batch, positions)
    history, history_lengths = drafted_history(batch, drafts, positions, chooser)
    chosen, logprobs = chooser(scores, history, history_lengths, banned)
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    n = len(positions.steps)
    packed = torch.cat([chosen.double(), chosen_lp.double(), first.double()]).tolist()
    firsts = [int(t) for t in packed[2 * n :]]
    accepted: list[int] = []
    tokens: list[list[int]] = []
    lps: list[list[float]] = []
    at = 0
    for proposal, plain in zip(drafts.tokens, firsts, strict=True):
        later = [int(t) for t in packed[at : at + len(proposal)]]
        kept = kept_count([plain, *later], proposal)
        accepted.append(kept)
        tokens.append(later[:kept])
        lps.append(packed[n + at : n + at + kept])
        at += len(proposal)
    tops = None
    if batch.top_n is not None:
        flat_tops = top_tokens(
            logprobs, [batch.requests[row].top_n_tokens for row in positions.batch_rows]
        )
        starts = [sum(len(t) for t in drafts.tokens[:i]) for i in range(len(drafts.rows))]
        tops = [flat_tops[at : at + a] for at, a in zip(starts, accepted, strict=True)]
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
            r.draft.record(len(drafts.tokens[i]), verified.accepted[i], r.seed is not None)
        if r.id in done or not verified.accepted[i]:
            continue
        g = generations[row]
        stream = TextStreams([batch.streams.streams[row]])
        emitted: list[int] = []
        for j, token in enumerate(verified.tokens[i]):
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
                set_generated_text(g.generated_text, r, reason, detokenizer)
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


def _add_top(
    out: generate_pb2.Tokens, top: tuple[list[int], list[float]], detokenizer: Detokenizer
) -> None:
    ids, lps = top
    out.ids.extend(ids)
    out.logprobs.extend(lps)
    out.texts.extend(detokenizer.token_texts(ids))
    out.is_special.extend(i in detokenizer.special_ids for i in ids)
