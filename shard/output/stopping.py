"""When a request stops: max_new_tokens, an EOS token, or a stop sequence in its text.

`StoppingCriteria` is one request's rule, checked per token (the reference). A decode step decides
the length and EOS stops of the whole batch at once with `BatchStops`, from two numbers and one set
test on the step's ids (no device op, no per-row loop unless some row stops); only stop sequences,
which need the new text, are checked per request (`StoppingCriteria.matches`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pytgi_proto import generate_pb2

LENGTH = generate_pb2.FINISH_REASON_LENGTH
EOS_TOKEN = generate_pb2.FINISH_REASON_EOS_TOKEN
STOP_SEQUENCE = generate_pb2.FINISH_REASON_STOP_SEQUENCE


class StoppingCriteria:
    """One request's stopping state, checked after every generated token, in TGI's order:
    length first, then EOS, then stop sequences."""

    __slots__ = ("max_new_tokens", "eos_ids", "stop_sequences", "generated", "_tail", "_keep")

    def __init__(
        self, max_new_tokens: int, eos_ids: Iterable[int], stop_sequences: Sequence[str] = ()
    ) -> None:
        self.max_new_tokens = max_new_tokens
        self.eos_ids = frozenset(eos_ids)
        self.stop_sequences = [s for s in stop_sequences if s]
        self.generated = 0
        # Only the last (longest stop - 1) characters can start a match that the next text ends.
        self._keep = max((len(s) for s in self.stop_sequences), default=1) - 1
        self._tail = ""

    def __call__(self, token_id: int, text: str) -> int | None:
        """Counts the token; returns a FinishReason when the request is done, else None.

        `text` is the new text the token produced (possibly "" while a character is incomplete).
        """
        self.generated += 1
        if self.generated >= self.max_new_tokens:
            return LENGTH
        if token_id in self.eos_ids:
            return EOS_TOKEN
        if self.matches(text):
            return STOP_SEQUENCE
        return None

    def prime(self, text: str) -> None:
        """Takes `text` as already seen (a resumed request's earlier output): a stop sequence
        may begin in it and end in the next token's text."""
        window = self._tail + text
        self._tail = window[-self._keep :] if self._keep else ""

    def matches(self, text: str) -> bool:
        """Whether a stop sequence ends inside `text` (the new text, appended to what came
        before); asked once per token that neither the length nor EOS stopped."""
        if not self.stop_sequences or not text:
            return False
        # A stop sequence may end anywhere inside the new text, not only at its end.
        window = self._tail + text
        if any(s in window for s in self.stop_sequences):
            return True
        self._tail = window[-self._keep :] if self._keep else ""
        return False


class BatchStops:
    """The length and EOS stops of a batch's rows, decided on the host from the step's ids.

    Both are known without any per-row work on most steps: every row appends one token per
    step, so no row reaches its length before the fewest tokens any row has left, and no row
    ends on EOS unless one of the step's ids is some row's EOS id (one set test). Only a step
    where either may happen looks at the rows.
    """

    __slots__ = ("left", "eos_ids", "_min_left", "_any_eos")

    def __init__(self, left: Sequence[int], eos_ids: Sequence[frozenset[int]]) -> None:
        # Per row, the tokens it may append before max_new_tokens, as of the batch's start
        # (its appends since are the `steps` the caller passes).
        self.left = list(left)
        # Per row, its EOS ids (empty under ignore_eos).
        self.eos_ids = list(eos_ids)
        self._min_left = min(self.left, default=0)
        self._any_eos = frozenset().union(*self.eos_ids)

    @classmethod
    def build(cls, criteria: Sequence[StoppingCriteria]) -> BatchStops:
        """The stops of a batch starting now, of requests that generated `criteria[i].generated`
        tokens so far (a request resumed after preemption: its generated_ids)."""
        return cls(
            [c.max_new_tokens - c.generated for c in criteria], [c.eos_ids for c in criteria]
        )

    def index(self, rows: Sequence[int], steps: int) -> BatchStops:
        """The listed rows' stops for a batch that starts now, `steps` appends after this one."""
        return BatchStops([self.left[i] - steps for i in rows], [self.eos_ids[i] for i in rows])

    @classmethod
    def concatenate(cls, stops: Sequence[BatchStops], steps: Sequence[int]) -> BatchStops:
        """One batch's stops, starting now, from batches `steps[i]` appends after theirs began."""
        return cls(
            [n - k for s, k in zip(stops, steps, strict=True) for n in s.left],
            [e for s in stops for e in s.eos_ids],
        )

    def consume(self, row: int, count: int) -> None:
        """`row` appended `count` tokens beyond the batch's one per step (a verification step
        kept drafts): fewer are left to it."""
        self.left[row] -= count
        self._min_left = min(self._min_left, self.left[row])

    def finished(self, tokens: Sequence[int], steps: int) -> list[tuple[int, int]]:
        """(row, LENGTH or EOS_TOKEN) of each row that stops, in row order, once `tokens` are
        appended as the batch's `steps`-th token of every row, as StoppingCriteria decides
        before it looks at stop sequences."""
        if self._min_left > steps and self._any_eos.isdisjoint(tokens):
            return []
        return [
            (row, LENGTH if left <= steps else EOS_TOKEN)
            for row, (left, eos, token) in enumerate(
                zip(self.left, self.eos_ids, tokens, strict=True)
            )
            if left <= steps or token in eos
        ]
