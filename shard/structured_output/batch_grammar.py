"""The grammar state of a batch's constrained rows, and their next token masks.

Each constrained row holds its request's llguidance matcher. Once a step's tokens reach the host
(generation.emit_generations), `advance` hands them to the mask worker (shard/structured_output/worker.py),
which feeds each matcher its token and computes every constrained row's bitmask of allowed next
tokens: in the grammar thread while the engine answers the router and the next forward runs (an
accelerator), or at once on the engine's thread (the CPU, where the forward holds every core).
The next step's `banned` waits for those words and turns them into what sampling applies to the
logits in one op before anything else (on the CPU a float32 bias, built on the engine's thread
once the forward is over; on an accelerator banned tokens for a masked fill:
shard/structured_output/masks.py), wherever the logits came from (a forward, a look-ahead, a CUDA graph).

A request's first mask was computed with its matcher, off the step (shard/structured_output/compiler.py), so its
first step only copies it. Every mask computation also says which matchers are in llguidance's
error state (a limit hit, a refused token): `banned` notes those rows in `failed`, and the step
reports them as failed requests (generation.emit_generations) rather than sampling the EOS that
an error state's mask allows.

Rows move between batches (filter, concatenate) while their masks may still be on the way: a
row is a `GrammarRow` whose identity survives the moves, and the pending masks are matched back
to the batch's current rows when they are read. A batch with no constrained row has no
BatchGrammar at all, so free requests pay nothing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from pytgi_shard.structured_output.cache import Prepared
from pytgi_shard.structured_output.compiler import GrammarCompiler, GrammarSpec, first_line
from pytgi_shard.structured_output.masks import SharedBias, host_masks, unpack_with_torch


class GrammarRow:
    """One constrained request's matcher; set by the worker, which alone touches it."""

    __slots__ = ("matcher",)

    def __init__(self) -> None:
        self.matcher: llguidance.LLMatcher | None = None


@dataclass(frozen=True, slots=True)
class RowMasks:
    """The next masks of some rows, in order: [rows, mask_width] int32 words, and the rows
    whose matcher is in its error state (their index among these rows: llguidance's reason)."""

    words: torch.Tensor
    failed: dict[int, str]


@dataclass(frozen=True, slots=True)
class _PendingMasks:
    """Masks being computed for `rows` (in that order)."""

    rows: tuple[GrammarRow, ...]
    banned: Future[RowMasks]


class BatchGrammar:
    """The constrained rows of one batch (None for a free row) and their pending masks."""

    def __init__(
        self,
        rows: list[GrammarRow | None],
        pending: list[_PendingMasks],
        compiler: GrammarCompiler,
        device: torch.device,
    ) -> None:
        self.rows = rows
        self.pending = pending
        self.compiler = compiler
        self.device = device
        self.constrained = [row for row, r in enumerate(rows) if r is not None]
        # Batch rows whose matcher failed, with the reason: set by `banned` for this step.
        self.failed: dict[int, str] = {}
        # Row indices of the constrained rows; None when every row is constrained.
        self.index: torch.Tensor | None = None
        if len(self.constrained) < len(rows):
            self.index = torch.tensor(self.constrained, dtype=torch.long, device=device)

    @classmethod
    def start(
        cls,
        specs: Sequence[GrammarSpec | None],
        generated: Sequence[Sequence[int]],
        samples: Sequence[bool],
        compiler: GrammarCompiler,
        device: torch.device,
    ) -> BatchGrammar | None:
        """The grammar state of a new batch's rows: for the rows that sample this step
        (`samples`: not a partial prefill, which only warms the cache) the matcher prepared for
        the request (or built now; an invalid grammar raises InvalidRequest before anything
        runs), then in the worker a resumed row's generated tokens replayed and its first mask
        computed; the others' first masks were computed with their matchers."""
        rows = [
            GrammarRow() if spec is not None and sample else None
            for spec, sample in zip(specs, samples, strict=True)
        ]
        if all(r is None for r in rows):
            return None
        work = [
            (row, compiler.take(spec), ids)
            for row, spec, ids in zip(rows, specs, generated, strict=True)
            if row is not None and spec is not None
        ]
        out = tuple(row for row, _, _ in work)
        future = compiler.worker.run(_first_masks, work, compiler)
        return cls(rows, [_PendingMasks(out, future)], compiler, device)

    def banned(self) -> tuple[torch.Tensor | None, torch.Tensor | SharedBias]:
        """(constrained row indices or None for all rows, their masks: on the CPU a [rows,
        vocab] float32 bias or the bias of runs of rows sharing a mask, elsewhere [rows, vocab]
        bool banned tokens; sampling.ban_tokens) for the current step; waits for the worker
        when it is still computing them."""
        start = time.perf_counter()
        words, failed = self._current_masks()
        self.failed = {self.constrained[j]: reason for j, reason in failed.items()}
        timings = self.compiler.worker.timings
        waited = time.perf_counter()
        timings.wait_s += waited - start
        masks = self._on_device(words)
        timings.convert_s += time.perf_counter() - waited
        timings.shared_steps += isinstance(masks, SharedBias)
        return self.index, masks

    def _current_masks(self) -> tuple[torch.Tensor, dict[int, str]]:
        """The pending masks of the batch's constrained rows, in row order, and the failed ones
        among them (by their index among the constrained rows)."""
        parts = self.pending
        current = tuple(r for r in self.rows if r is not None)
        if len(parts) == 1 and parts[0].rows == current:
            masks = parts[0].banned.result()
            return masks.words, masks.failed
        position = {id(r): (p, i) for p, part in enumerate(parts) for i, r in enumerate(part.rows)}
        results = [part.banned.result() for part in parts]
        offsets = np.cumsum([0] + [len(part.rows) for part in parts])
        stacked = torch.cat([m.words for m in results]) if len(results) > 1 else results[0].words
        picks = [int(offsets[position[id(r)][0]]) + position[id(r)][1] for r in current]
        pick = torch.tensor(picks, dtype=torch.long, device=stacked.device)
        failed: dict[int, str] = {}
        if any(m.failed for m in results):
            for j, r in enumerate(current):
                p, i = position[id(r)]
                if i in results[p].failed:
                    failed[j] = results[p].failed[i]
        return stacked.index_select(0, pick), failed

    def _on_device(
        self, words: torch.Tensor, rows: Sequence[int] | None = None
    ) -> torch.Tensor | SharedBias:
        """The words as sampling applies them to `rows` of its scores (None: the constrained
        rows): on the CPU the float32 bias (valid until the next call: sampling applies it at
        once); on an accelerator they travel (32x smaller than the banned tokens) and are
        unpacked there, on the engine's thread and stream."""
        vocab = self.compiler.vocab_size
        if self.device.type == "cpu":
            rows = self.constrained if rows is None else rows
            return host_masks(self.compiler.worker.host_bias, words, vocab, rows)
        return unpack_with_torch(words.to(self.device, non_blocking=True), vocab)

    def drafted_banned(
        self,
        rows: Sequence[int],
        drafts: Sequence[Sequence[int]],
        first: Sequence[int],
        position_rows: Sequence[int],
    ) -> tuple[torch.Tensor | None, torch.Tensor | SharedBias] | None:
        """The masks of a verification step's drafted positions (shard/engine/draft_positions.py:
        position j of a row that drafted d_0 .. d_(n-1) follows d_(j-1)), for the positions of
        constrained rows: (their index among the positions, or None for all; their masks, as
        `banned`); None when no drafting row is constrained. `rows` drafted `drafts`; `first`:
        their plain tokens of the step, which `advance` fed the matchers (a row whose first
        draft is not that token keeps no draft: its positions get no mask). `position_rows`:
        each position's batch row. Computed on copies of the matchers, after the worker's
        pending work (the first tokens consumed)."""
        constrained = [p for p, row in enumerate(position_rows) if self.rows[row] is not None]
        if not constrained:
            return None
        work = [
            (grammar_row, list(tokens), tokens[0] == token)
            for row, tokens, token in zip(rows, drafts, first, strict=True)
            if (grammar_row := self.rows[row]) is not None
        ]
        words = self.compiler.worker.run(_drafted_masks, work, self.compiler).result()
        index = None
        if len(constrained) < len(position_rows):
            index = torch.tensor(constrained, dtype=torch.long, device=self.device)
        return index, self._on_device(words, constrained)

    def advance_kept(self, kept: dict[int, Sequence[int]]) -> None:
        """After a verification step's `advance`: feeds the listed batch rows (row -> tokens)
        the drafts they kept and the token after them, and computes every constrained row's
        next masks again."""
        runs = [list(kept.get(row, ())) for row in self.constrained]
        if not any(runs):
            return
        rows = tuple(r for r in self.rows if r is not None)
        future = self.compiler.worker.run(_advance_runs_and_mask, rows, runs, self.compiler)
        self.pending = [_PendingMasks(rows, future)]

    def advance(self, tokens: Sequence[int]) -> None:
        """Feeds each constrained row its new token (tokens[row], for every row of the batch)
        and starts computing the next masks."""
        start = time.perf_counter()
        worker = self.compiler.worker
        rows = tuple(r for r in self.rows if r is not None)
        taken = [tokens[row] for row in self.constrained]
        future = worker.run(_advance_and_mask, rows, taken, self.compiler)
        self.pending = [_PendingMasks(rows, future)]
        worker.timings.handoff_s += time.perf_counter() - start

    def filter(self, indices: Sequence[int]) -> BatchGrammar | None:
        rows = [self.rows[i] for i in indices]
        if all(r is None for r in rows):
            return None
        return BatchGrammar(rows, self.pending, self.compiler, self.device)

    @classmethod
    def concatenate(
        cls, parts: Sequence[BatchGrammar | None], sizes: Sequence[int]
    ) -> BatchGrammar | None:
        """The grammar state of batches concatenated in order (`sizes`: each batch's rows)."""
        present = [g for g in parts if g is not None]
        if not present:
            return None
        rows: list[GrammarRow | None] = []
        for g, size in zip(parts, sizes, strict=True):
            rows.extend(g.rows if g is not None else [None] * size)
        pending = [p for g in present for p in g.pending]
        return cls(rows, pending, present[0].compiler, present[0].device)


def _first_masks(
    work: list[tuple[GrammarRow, Prepared, Sequence[int]]], compiler: GrammarCompiler
) -> RowMasks:
    """The rows' first masks: the prepared ones as they were computed, a resumed row's after
    its generated tokens are replayed (a refused one leaves its matcher failed)."""
    words = np.empty((len(work), compiler.mask_width), dtype=np.int32)
    replayed = []
    for i, (row, prepared, generated) in enumerate(work):
        row.matcher = prepared.matcher
        if generated:
            prepared.matcher.consume_tokens(list(generated))
            replayed.append(i)
        else:
            words[i] = prepared.words
    if replayed:
        fresh = np.empty((len(replayed), compiler.mask_width), dtype=np.int32)
        compiler.worker.fill_masks([_matcher(work[i][0]) for i in replayed], fresh)
        words[replayed] = fresh
    return RowMasks(torch.from_numpy(words), _failures([_matcher(row) for row, _, _ in work]))


def _advance_and_mask(
    rows: tuple[GrammarRow, ...], tokens: list[int], compiler: GrammarCompiler
) -> RowMasks:
    start = time.perf_counter()
    compiler.worker.consume([_matcher(row) for row in rows], tokens)
    compiler.worker.timings.consume_s += time.perf_counter() - start
    compiler.worker.timings.steps += 1
    return _masks(list(rows), compiler)


def _advance_runs_and_mask(
    rows: tuple[GrammarRow, ...], runs: list[list[int]], compiler: GrammarCompiler
) -> RowMasks:
    """Feeds each row its run of tokens (a refused one leaves the matcher failed, reported by
    its next mask), then computes every row's mask."""
    for row, run in zip(rows, runs, strict=True):
        for token in run:  # one at a time, as `advance` feeds the plain step's token
            _matcher(row).consume_token(token)
    return _masks(list(rows), compiler)


def _drafted_masks(
    work: list[tuple[GrammarRow, list[int], bool]], compiler: GrammarCompiler
) -> torch.Tensor:
    """[positions, mask_width] words: per row (its drafts d_0 .. d_(n-1), whether d_0 is the
    token its matcher consumed last), the masks after d_0 .. d_(j-1) for j = 1 .. n, on a copy
    of its matcher. Positions the step cannot keep (d_0 not consumed, or a draft before them
    the grammar refuses, which the masked choice then never picks) get any mask: all allowed,
    or the last one computed."""
    total = sum(len(tokens) for _, tokens, _ in work)
    words = np.empty((total, compiler.mask_width), dtype=np.int32)
    at = 0
    for row, tokens, usable in work:
        n = len(tokens)
        if not usable:
            words[at : at + n] = -1
            at += n
            continue
        copy = _matcher(row).deep_copy()
        for j in range(n):
            if j:
                if not _allows(words[at + j - 1], tokens[j]):
                    words[at + j : at + n] = words[at + j - 1]
                    break
                copy.consume_token(tokens[j])
            compiler.worker.fill_masks([copy], words[at + j : at + j + 1])
        at += n
    return torch.from_numpy(words)


def _allows(words: np.ndarray, token: int) -> bool:
    """Whether a bitmask's words allow `token` (bit token % 32 of word token // 32)."""
    return bool((int(words[token >> 5]) >> (token & 31)) & 1)


def _masks(rows: Sequence[GrammarRow], compiler: GrammarCompiler) -> RowMasks:
    """The rows' next-token masks: [rows, mask_width] int32 bitmask words, and the rows whose
    matcher failed. What sampling applies is made of them on the engine's thread
    (BatchGrammar._on_device): this only does what needs the matchers."""
    worker = compiler.worker
    start = time.perf_counter()
    # Not zeroed: every mask computation writes its whole row (an error state's too), and
    # zeros of 64 x 4k words are fresh pages to fault in on every step (~0.1 ms).
    words = np.empty((len(rows), compiler.mask_width), dtype=np.int32)
    matchers = [_matcher(row) for row in rows]
    worker.fill_masks(matchers, words)
    failed = _failures(matchers)
    worker.timings.mask_s += time.perf_counter() - start
    return RowMasks(torch.from_numpy(words), failed)


def _failures(matchers: Sequence[llguidance.LLMatcher]) -> dict[int, str]:
    """The matchers in llguidance's error state (by index), with the reason. An error state
    lasts: its mask allows only EOS, which would end the request as if its output were
    complete; it must fail instead."""
    return {i: first_line(m.get_error()) for i, m in enumerate(matchers) if m.is_error()}


def _matcher(row: GrammarRow) -> llguidance.LLMatcher:
    """The row's matcher: set by the worker's earlier task for that row (it runs in order)."""
    if row.matcher is None:
        raise RuntimeError("a grammar row was advanced before its matcher was built")
    return row.matcher
