"""When a request stops: max_new_tokens, an EOS token, or a stop sequence in its text."""

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
        if self.stop_sequences and text:
            # A stop sequence may end anywhere inside the new text, not only at its end.
            window = self._tail + text
            if any(s in window for s in self.stop_sequences):
                return STOP_SEQUENCE
            self._tail = window[len(window) - self._keep :] if self._keep else ""
        return None
