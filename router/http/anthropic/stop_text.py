"""Anthropic's answer text ends before the stop sequence that ended it, and says which one
(`stop_sequence`); the shard's text holds the sequence and whatever followed it in the last
token. Streamed, the text that may yet turn out to begin a stop sequence is held back until a
later token or the end decides, so that no stop sequence is ever sent.
"""

from __future__ import annotations


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """`text` up to the stop sequence that ended it (the one whose end comes first: the shard
    stops as soon as one ends), and that sequence; `text` and None when none is in it."""
    best: tuple[int, int, str] | None = None  # (end, start, sequence)
    for stop in stops:
        at = text.find(stop) if stop else -1
        if at >= 0 and (best is None or at + len(stop) < best[0]):
            best = (at + len(stop), at, stop)
    if best is None:
        return text, None
    return text[:best[1]], best[2]


def held_suffix(text: str, stops: list[str]) -> int:
    """The length of the longest end of `text` that begins some stop sequence (without being
    all of it): those characters may be the start of a stop sequence a later token finishes.
    Only the prefixes ending in `text`'s last character are compared (found by `rfind`): the
    stream asks this once per token."""
    if not text:
        return 0
    last = text[-1]
    best = 0
    for stop in stops:
        # j: where a prefix stop[:j + 1] ends with `last`; longer than `best`, shorter than both.
        j = stop.rfind(last, 0, min(len(stop) - 1, len(text)))
        while j >= best:
            if text.endswith(stop[:j + 1]):
                best = j + 1
                break
            j = stop.rfind(last, 0, j)
    return best


class StopText:
    """A plain answer streamed without its stop sequence: `push` gives each piece of the
    answer less what may begin a stop sequence; `flush` the rest at the end, cut where the
    stop sequence began when one ended the answer."""

    __slots__ = ("stops", "_held")

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""

    def push(self, piece: str) -> str:
        if not self.stops:
            return piece
        text = self._held + piece
        before, sequence = cut_at_stop(text, self.stops)
        if sequence is not None:  # held from its start on: `flush` decides whether it stopped
            self._held = text[len(before):]
            return before
        keep = held_suffix(text, self.stops)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self, stopped: bool) -> str:
        """What was held back; `stopped`: a stop sequence ended the answer (the last token may
        hold one when the token limit came first: then nothing is cut)."""
        rest, self._held = self._held, ""
        return cut_at_stop(rest, self.stops)[0] if stopped else rest
