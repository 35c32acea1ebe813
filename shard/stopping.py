"""When a request stops: max_new_tokens, an EOS token, or a stop sequence in its text.

`StoppingCriteria` is one request's rule, checked per token (the reference). A decode step decides
the length and EOS stops of the whole batch at once on the device with `BatchStops`, so they come
back with the step's tokens in one transfer; only stop sequences, which need the new text, are
checked per request on the host (`StoppingCriteria.matches`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from pytgi_proto import generate_pb2

LENGTH = generate_pb2.FINISH_REASON_LENGTH
EOS_TOKEN = generate_pb2.FINISH_REASON_EOS_TOKEN
STOP_SEQUENCE = generate_pb2.FINISH_REASON_STOP_SEQUENCE
# Not a FinishReason: the request goes on.
RUNNING = -1
# Pads rows of BatchStops.eos_ids: no token id equals it.
_NO_TOKEN = -1


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


@dataclass(frozen=True, slots=True)
class BatchStops:
    """The length and EOS stops of a batch's rows, as device tensors aligned with its rows."""

    # [batch] int64: the length (prompt + generated) at which a row reached max_new_tokens.
    stop_lengths: torch.Tensor
    # [batch, n] int64: each row's EOS ids, padded with -1 (all -1 under ignore_eos).
    eos_ids: torch.Tensor

    @classmethod
    def build(
        cls,
        prompt_lengths: Sequence[int],
        criteria: Sequence[StoppingCriteria],
        device: torch.device,
    ) -> BatchStops:
        stop_lengths = [p + c.max_new_tokens for p, c in zip(prompt_lengths, criteria, strict=True)]
        width = max((len(c.eos_ids) for c in criteria), default=0) or 1
        eos = [sorted(c.eos_ids) + [_NO_TOKEN] * (width - len(c.eos_ids)) for c in criteria]
        return cls(
            torch.tensor(stop_lengths, dtype=torch.long, device=device),
            torch.tensor(eos, dtype=torch.long, device=device).view(len(criteria), width),
        )

    def index(self, rows: torch.Tensor) -> BatchStops:
        return BatchStops(self.stop_lengths[rows], self.eos_ids[rows])

    @classmethod
    def concatenate(cls, stops: Sequence[BatchStops]) -> BatchStops:
        width = max(s.eos_ids.shape[1] for s in stops)
        return cls(
            torch.cat([s.stop_lengths for s in stops]),
            torch.cat(
                [
                    torch.nn.functional.pad(
                        s.eos_ids, (0, width - s.eos_ids.shape[1]), value=_NO_TOKEN
                    )
                    for s in stops
                ]
            ),
        )

    def reasons(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[batch] int64: LENGTH, EOS_TOKEN or RUNNING once `tokens` are appended and `lengths`
        count them, as StoppingCriteria decides before it looks at stop sequences."""
        eos = (self.eos_ids == tokens.unsqueeze(1)).any(dim=1)
        reasons = torch.where(eos, EOS_TOKEN, RUNNING)
        return reasons.masked_fill_(lengths >= self.stop_lengths, LENGTH)
