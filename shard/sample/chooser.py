"""The next-token chooser: logits processors and the choice, for a whole batch at once.

"Heterogeneous" as in TGI: every request keeps its own parameters, held as [batch, 1] tensors so
that one tensor op applies them all. A processor runs only when some request in the batch needs
it, so an all-greedy batch costs one argmax (`first_max`, fast on the CPU too) and one
log-softmax. Order, as TGI: watermark, repetition penalty, frequency penalty, then the warpers
temperature, top-k, top-p, typical-p; the grammar's bans come after the element-wise ones (with
which they commute) and before top-k.

A row is chosen as if it ran alone: the element-wise processors leave a row with neutral values
as it is, top-p and typical-p run only on the rows that asked (shard/sample/warped_rows.py), and every
per-row computation on the CPU takes an order of its own (see `entropy`), so a request's ids,
logprobs and top tokens for given logits do not depend on its neighbours
(tests/unit/shard/sample/test_sampling_rows.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pytgi_proto import generate_pb2
from pytgi_proto.parameters import wire_values
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.sample import categorical
from pytgi_shard.sample.argmax import first_max
from pytgi_shard.sample.blocked_choice import block_rows, blocked_greedy
from pytgi_shard.sample.candidate_warpers import (
    entropy,
    largest_kept_gap,
    removable_mass,
    top_candidates,
    top_p_over,
    typical_p_over,
)
from pytgi_shard.sample.processors import divide_by_temperature, penalize, saturate, shifted_rows
from pytgi_shard.sample.token_draws import TokenDraws
from pytgi_shard.sample.warped_rows import WarpedRows
from pytgi_shard.structured_output.masks import SharedBias

NEG_INF = float("-inf")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """One request's choice parameters; the neutral value of each means "off"."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    do_sample: bool = False
    seed: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    watermark: bool = False

    @classmethod
    def from_pb(cls, pb: generate_pb2.NextTokenChooserParameters) -> SamplingParams:
        """Proto3 sends 0 for a float that was never set: 0 reads as the neutral value. The
        grammar fields are shard/structured_output/compiler.py's. A NaN or infinite value (proto floats carry
        them) would make every score of the row NaN: refused, like a negative one."""
        for name in ("temperature", "top_p", "typical_p", "repetition_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(pb, name)):
                raise InvalidRequest(f"{name} must be a finite number, got {getattr(pb, name)}")
        for name in ("temperature", "top_p", "typical_p", "repetition_penalty"):
            if getattr(pb, name) < 0:
                raise InvalidRequest(f"{name} must not be negative, got {getattr(pb, name)}")
        for name in ("top_p", "typical_p"):
            if getattr(pb, name) > 1:
                raise InvalidRequest(f"{name} must be <= 1.0, got {getattr(pb, name)}")
        # One field per row of pytgi_proto.parameters.SAMPLING, 0 read as the row's neutral value.
        return cls(**wire_values(pb))

    @property
    def samples(self) -> bool:
        """Any warper implies sampling, as in TGI."""
        return (
            self.do_sample
            or self.temperature != 1.0
            or self.top_k > 0
            or self.top_p < 1.0
            or self.typical_p < 1.0
        )


@dataclass(frozen=True, slots=True)
class Watermark:
    """Kirchenbauer et al.: bias a pseudo-random "green list" seeded by the previous token."""

    gamma: float = 0.5
    delta: float = 2.0
    # The hash key of the paper's reference code (a large prime), so watermarks are detectable
    # with the same detector as TGI's.
    hash_key: int = 15485863

    def greenlist(self, previous_token: int, vocab_size: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.hash_key * previous_token)
        permutation = torch.randperm(vocab_size, generator=generator)
        return permutation[: int(vocab_size * self.gamma)]

    def apply(self, scores: torch.Tensor, rows: list[int], previous: list[int]) -> None:
        vocab = scores.shape[-1]
        for row, token in zip(rows, previous, strict=True):
            scores[row, self.greenlist(token, vocab).to(scores.device)] += self.delta


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


class NextTokenChooser:
    """Chooses one token per row of a [batch, vocab] logits tensor.

    Seeded sampling keeps one TokenDraws per sampling request (shard/sample/token_draws.py),
    carried across filter and concatenate: a request's draws for its i-th token are a function
    of its seed and i alone, so it draws the same numbers whatever batch it runs in, however
    many tokens its steps emit (speculative decoding) and after a resume.
    """

    def __init__(
        self,
        params: Sequence[SamplingParams],
        draws: Sequence[TokenDraws | None],
        device: torch.device,
        watermark: Watermark,
    ) -> None:
        self.params = list(params)
        self.draws = list(draws)
        self.device = device
        self.watermark = watermark
        # How sampling rows draw: by inverse transform on the CPU, by exponential noise on an
        # accelerator (an attribute, so the CPU tests can run the accelerator's way too).
        self.inverse_transform = device.type == "cpu"
        p = self.params
        self.watermark_rows = [i for i, x in enumerate(p) if x.watermark]
        self.sample_rows = [i for i, x in enumerate(p) if x.samples]
        self.sample_index = torch.tensor(self.sample_rows, dtype=torch.long, device=device)
        self.temperature = self._optional([x.temperature for x in p], 1.0)
        self.shifted = shifted_rows([x.temperature for x in p], device)
        self.repetition = self._optional([x.repetition_penalty for x in p], 1.0)
        self.frequency = self._optional([x.frequency_penalty for x in p], 0.0)
        top_k = [x.top_k for x in p]
        self.max_top_k = max(top_k, default=0)
        self.top_k = torch.tensor(top_k, dtype=torch.long, device=device).unsqueeze(1)
        self.warped = WarpedRows.of([x.top_p for x in p], [x.typical_p for x in p], top_k, device)
        # Penalties can overflow float32 (and a temperature then): their scores are bounded.
        self.saturates = self.repetition is not None or self.frequency is not None
        # Nothing but the grammar masks and argmax: the choice may run in row blocks.
        self.greedy_only = not (
            self.watermark_rows
            or self.sample_rows
            or self.max_top_k
            or self.warped is not None
            or any(x is not None for x in (self.temperature, self.repetition, self.frequency))
        )

    @classmethod
    def create(
        cls, params: Sequence[SamplingParams], device: torch.device, watermark: Watermark
    ) -> NextTokenChooser:
        draws = [TokenDraws(x.seed) if x.samples else None for x in params]
        return cls(params, draws, device, watermark)

    def skip_draws(self, counts: Sequence[int]) -> None:
        """Moves each sampling row's draws past `counts[row]` tokens it emitted without this
        chooser drawing them: a request resumed after preemption (its generated tokens), the
        drafts a verification step kept (chosen with their own indexes' draws)."""
        for row in self.sample_rows:
            draws = self.draws[row]
            if counts[row] and draws is not None:
                draws.index += counts[row]

    def _draw(self, draws: TokenDraws | None, vocab_size: int) -> torch.Tensor:
        """One sampling row's random numbers for its next token, as `__call__` uses them: the
        CPU's DRAWS uniforms, an accelerator's [vocab] row of Exponential(1) noise."""
        if draws is None:
            raise RuntimeError("a sampling row without its draws")
        generator = draws.generator(self.device)
        draws.index += 1
        if self.inverse_transform:
            return categorical.row_draws(generator)
        noise = torch.empty(vocab_size, device=self.device)
        return noise.exponential_(generator=generator)

    def _optional(self, values: list[float], neutral: float) -> torch.Tensor | None:
        if all(v == neutral for v in values):
            return None
        return _column(values, self.device)

    def filter(self, indices: Sequence[int]) -> NextTokenChooser:
        return NextTokenChooser(
            [self.params[i] for i in indices],
            [self.draws[i] for i in indices],
            self.device,
            self.watermark,
        )

    @classmethod
    def concatenate(cls, choosers: Sequence[NextTokenChooser]) -> NextTokenChooser:
        first = choosers[0]
        params = [x for c in choosers for x in c.params]
        draws = [d for c in choosers for d in c.draws]
        return cls(params, draws, first.device, first.watermark)

    def __call__(
        self,
        logits: torch.Tensor,
        history: torch.Tensor,
        lengths: torch.Tensor,
        banned: tuple[torch.Tensor | None, torch.Tensor | SharedBias] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Processes `logits` in place into (next ids [batch], logprobs [batch, vocab]), the
        logprobs in `logits`' own storage.

        history: [batch, width] token ids so far (prompt + generated), valid up to `lengths`.
        banned: the constrained rows' grammar masks (shard/structured_output/batch_grammar.py), applied after
        the element-wise processors (the same scores as before them: -inf stays -inf through
        each) and before the warpers, so top-k, top-p, typical-p and the choice see only the
        tokens the grammar allows, and a banned token stays -inf where the others saturate.
        logprobs are the log-softmax of the processed scores, as TGI reports them.
        """
        scores = logits
        if banned is not None and self.greedy_only and _host_bias(banned[1]):
            block = block_rows(scores)
            if block is not None:
                return blocked_greedy(scores, *banned, block), scores
        if self.watermark_rows:
            previous = history.gather(1, (lengths - 1).unsqueeze(1)).squeeze(1)
            rows = self.watermark_rows
            self.watermark.apply(scores, rows, previous[rows].tolist())
        if self.repetition is not None or self.frequency is not None:
            penalize(scores, history, lengths, self.repetition, self.frequency)
        if self.temperature is not None:
            divide_by_temperature(scores, self.temperature, self.shifted)
        if self.saturates:
            saturate(scores)
        if banned is not None:
            ban_tokens(scores, *banned)
        top_k_ids = _top_k(scores, self.top_k, self.max_top_k) if self.max_top_k > 0 else None
        if self.warped is not None:
            _warp(scores, self.warped, top_k_ids)
        batch = scores.shape[0]
        every_row_samples = len(self.sample_rows) == batch
        if every_row_samples:
            next_ids = torch.empty(batch, dtype=torch.long, device=self.device)
        else:
            next_ids = first_max(scores)
        if self.sample_rows and not self.inverse_transform:
            next_ids.index_copy_(0, self.sample_index, self._sample(scores[self.sample_index]))
        # Written over the scores: no second [batch, vocab] tensor to allocate and fill (after
        # a forward, its first touch costs ~0.1 ms at 256 x 4096 on the CPU).
        logprobs = torch.log_softmax(scores, dim=-1, out=scores)
        if self.sample_rows and self.inverse_transform:
            # The CPU draws from the logprobs themselves, 1 + 64 uniforms per row, with no
            # [rows, vocab] probabilities made (shard/sample/categorical.py).
            uniforms = torch.stack([self._draw(self.draws[i], 0) for i in self.sample_rows])
            subset = None if every_row_samples else self.sample_index
            drawn = categorical.draw_from_logprobs(logprobs, subset, uniforms)
            next_ids.index_copy_(0, self.sample_index, drawn)
        return next_ids, logprobs

    def _sample(self, scores: torch.Tensor) -> torch.Tensor:
        """An accelerator's draw from softmax(scores) per row, each from its request's own
        draws: argmax(p / E) with E ~ Exponential(1) per token, vectorised and with no
        host sync."""
        probs = torch.softmax(scores, dim=-1)
        vocab = probs.shape[-1]
        noise = torch.stack([self._draw(self.draws[i], vocab) for i in self.sample_rows])
        return first_max(probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny))


def ban_tokens(
    scores: torch.Tensor, rows: torch.Tensor | None, masks: torch.Tensor | SharedBias
) -> None:
    """The constrained rows' grammar masks applied to the listed rows (None: every row), in one
    op whatever their number. `masks` ([len(rows), vocab]) is either a float32 bias, 0.0 where
    allowed and -inf where banned (the CPU's: adding is vectorised there, a masked fill is not;
    shard/structured_output/masks.py), or bool, True where banned (an accelerator's); or the CPU's bias
    of runs of rows sharing a mask (SharedBias, which knows its rows: one add per run)."""
    if isinstance(masks, SharedBias):
        masks.apply(scores)
        return
    masks = masks.to(scores.device, non_blocking=True)
    if masks.dtype != torch.bool:
        if rows is None:
            scores.add_(masks)
        else:
            scores.index_add_(0, rows, masks)
    elif rows is None:
        scores.masked_fill_(masks, NEG_INF)
    else:
        scores.index_copy_(0, rows, scores.index_select(0, rows).masked_fill_(masks, NEG_INF))


def _host_bias(masks: torch.Tensor | SharedBias) -> bool:
    return isinstance(masks, SharedBias) or masks.dtype != torch.bool


def _warp(scores: torch.Tensor, warped: WarpedRows, top_k_ids: torch.Tensor | None) -> None:
    """Top-p and typical-p on the rows that asked for either (a copy of them when not every
    row did); over their top-k candidates when each has a top-k (the same result with no sort
    of the vocabulary)."""
    part = warped.select(scores)
    if top_k_ids is not None and warped.top_k_everywhere:
        candidates = top_candidates(part, warped.select(top_k_ids))
        if warped.top_p is not None:
            top_p_over(part, candidates, warped.top_p)
        if warped.typical_p is not None:
            typical_p_over(part, candidates, warped.typical_p)
    else:
        if warped.top_p is not None:
            _top_p(part, warped.top_p)
        if warped.typical_p is not None:
            _typical_p(part, warped.typical_p)
    warped.put_back(scores, part)


def _top_k(scores: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Masks each row below its k-th value (ties stay); returns the ids of the batch's top-k."""
    vocab = scores.shape[-1]
    largest = torch.topk(scores, min(max_top_k, vocab), dim=-1)
    kth = largest.values.gather(1, (top_k.clamp(max=vocab) - 1).clamp(min=0))
    # Rows with top_k = 0 keep everything.
    kth.masked_fill_(top_k == 0, NEG_INF)
    scores.masked_fill_(scores < kth, NEG_INF)
    return largest.indices


def _top_p(scores: torch.Tensor, top_p: torch.Tensor) -> None:
    """Masks each row's least likely tokens whose mass adds up to at most 1 - top_p."""
    # Stable: tied scores at the cut are removed in token-id order, on every device.
    sorted_scores, order = torch.sort(scores, dim=-1, stable=True)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= removable_mass(top_p)
    # The most likely token always stays.
    remove[:, -1] = False
    scores.masked_fill_(remove.scatter(1, order, remove), NEG_INF)


def _typical_p(scores: torch.Tensor, mass: torch.Tensor) -> None:
    """Keeps each row's tokens closest to its entropy in surprise, up to `mass` of probability."""
    logp = torch.log_softmax(scores, dim=-1)
    surprise_gap = (-logp - entropy(logp)).abs()
    sorted_gap, order = torch.sort(surprise_gap, dim=-1, stable=True)
    cumulative = scores.gather(1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass).sum(dim=1, keepdim=True).clamp(max=scores.shape[-1] - 1)
    remove = sorted_gap > largest_kept_gap(sorted_gap.gather(1, last), mass)
    scores.masked_fill_(remove.scatter(1, order, remove), NEG_INF)


def top_tokens(logprobs: torch.Tensor, top_n: Sequence[int]) -> list[tuple[list[int], list[float]]]:
    """Per row, exactly the `top_n[row]` most likely (id, logprob) (fewer only when fewer tokens
    are left unfiltered), by logprob then token id: a tie at the n-th value must not list the
    whole vocabulary (temperature 1e9 ties every token; 128k entries a step on Llama 3).

    On the device, then one transfer: this runs on every decode step of a batch that asked.
    """
    rows, vocab = len(top_n), logprobs.shape[-1]
    max_n = min(max(top_n, default=0), vocab)
    if max_n == 0:
        return [([], [])] * rows
    device = logprobs.device
    n = torch.tensor(top_n, dtype=torch.long, device=device).clamp(max=max_n).unsqueeze(1)
    values, indices = torch.topk(logprobs, max_n, dim=-1)
    nth = values.gather(1, (n - 1).clamp(min=0))
    # All the tokens above the n-th value are in `values` (fewer than n of them) ...
    above = (values > nth).sum(dim=1, keepdim=True)
    # ... the rest are ties at the n-th value, lowest ids first: topk of (vocab - id) over them.
    reversed_ids = torch.arange(vocab, 0, -1, dtype=torch.int32, device=device)
    tie_keys = torch.topk((logprobs == nth) * reversed_ids, max_n, dim=-1).values
    position = torch.arange(max_n, device=device).unsqueeze(0)
    tie_ids = vocab - tie_keys.gather(1, (position - above).clamp(min=0)).long()
    from_top = position < above
    ids = torch.where(from_top, indices, tie_ids)
    lps = torch.where(from_top, values, nth)
    # A -inf n-th value would tie with every filtered token: only the finite ones above it then.
    count = torch.where(nth > NEG_INF, n, above)
    lps = lps.masked_fill(position >= count, NEG_INF)
    # Ties above the n-th value come from topk in no set order: by logprob, then id.
    ids, order = torch.sort(ids, dim=-1)
    lps, by_value = torch.sort(lps.gather(1, order), dim=-1, descending=True, stable=True)
    ids = ids.gather(1, by_value)
    packed = torch.cat((count.double(), ids.double(), lps.double()), dim=1).tolist()
    return [(_ints(r[1 : 1 + int(r[0])]), r[1 + max_n : 1 + max_n + int(r[0])]) for r in packed]


def _ints(values: list[float]) -> list[int]:
    return [int(v) for v in values]
