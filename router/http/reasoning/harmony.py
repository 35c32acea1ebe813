"""gpt-oss's harmony format, as vLLM's `gpt_oss` parser reads it: the output is a run of messages
`<|channel|>NAME<|message|>BODY<|end|>`, each after `<|start|>assistant` but the first (the
template's generation prompt ends with `<|start|>assistant`); the `analysis` channel is the
thinking, `final` the answer. `commentary` (preambles, and harmony's own tool calls, which pytgi
does not read: its tools are a grammar) is given as answer text. The last message ends with
`<|return|>` or `<|call|>` (the model's stop tokens).

The markers are special tokens, so this parser reads every special token's text
(`reads_special`): the answer's decoded text omits them. An output with no marker at all is
all answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pytgi_router.http.reasoning.pieces import Piece

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
ENDS = frozenset({END, RETURN, CALL})
THINKING_CHANNEL = "analysis"

State = Literal["lead", "role", "header", "body", "after"]


def marker_at(text: str, i: int) -> str | None:
    """The marker that starts at `text[i]` (where `text[i:]` begins with `<|`), "" when the
    text ends inside what may still become one, None when it is plain text."""
    rest = text[i:]
    for marker in MARKERS:
        if rest.startswith(marker):
            return marker
    if any(marker.startswith(rest) for marker in MARKERS):
        return ""
    return None


def prompt_channel(prompt: str) -> str | None:
    """The channel whose body the prompt leaves open (a template that ends inside a message),
    else None."""
    tail = prompt.rstrip()
    if not tail.endswith(MESSAGE):
        return None
    at = tail.rfind(CHANNEL)
    if at < 0:
        return "final"
    return tail[at + len(CHANNEL):-len(MESSAGE)].split(CONSTRAIN)[0].strip().split(" ")[0]


class HarmonySplitter:
    """One response read as harmony messages: a state machine over text and markers, holding
    back a marker's start until a later delta completes it."""

    __slots__ = ("_state", "_channel", "_header", "_held")

    def __init__(self, channel: str | None = None) -> None:
        self._state: State = "lead" if channel is None else "body"
        self._channel = channel or "final"
        self._header: list[str] = []
        self._held = ""

    @property
    def thinking(self) -> bool:
        if self._state == "header":
            return "".join(self._header).strip().startswith(THINKING_CHANNEL)
        return self._state == "body" and self._channel == THINKING_CHANNEL

    def push(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        held = self._held + text
        i = 0
        while (at := held.find("<|", i)) >= 0:
            marker = marker_at(held, at)
            if marker is None:  # `<|` that starts no marker: text
                self._text(held[i:at + 2], out)
                i = at + 2
                continue
            self._text(held[i:at], out)
            if marker == "":
                self._held = held[at:]
                return out
            self._marker(marker)
            i = at + len(marker)
        rest = held[i:]
        keep = 1 if rest.endswith("<") else 0  # perhaps the start of `<|`
        self._text(rest[:len(rest) - keep], out)
        self._held = rest[len(rest) - keep:]
        return out

    def finish(self) -> list[Piece]:
        """A marker cut short is text of the message it was in."""
        out: list[Piece] = []
        held, self._held = self._held, ""
        self._text(held, out)
        return out

    def _text(self, text: str, out: list[Piece]) -> None:
        if not text:
            return
        if self._state == "lead":
            self._state, self._channel = "body", "final"
        if self._state == "header":
            self._header.append(text)
        elif self._state == "body":
            out.append(Piece("reasoning" if self._channel == THINKING_CHANNEL else "content", text))

    def _marker(self, marker: str) -> None:
        if marker == CHANNEL:
            self._state, self._header = "header", []
        elif marker == MESSAGE:
            self._state, self._channel = "body", self._header_channel()
        elif marker == START:
            self._state = "role"
        elif marker in ENDS:
            self._state = "after"
        # CONSTRAIN belongs to a header (`<|constrain|>json`): its text stays in the header.

    def _header_channel(self) -> str:
        """The channel a header names (`analysis`, `commentary to=functions.f`...): its first
        word; a message with no header is the answer."""
        if self._state != "header":
            return "final"
        words = "".join(self._header).split()
        return words[0] if words else "final"


@dataclass(frozen=True, slots=True)
class HarmonyParser:
    """vLLM's `gpt_oss` parser."""

    name: str = "gpt_oss"

    def reads_special(self, text: str) -> bool:
        """Every special token: the markers are."""
        return True

    def splitter(self, prompt: str) -> HarmonySplitter:
        return HarmonySplitter(prompt_channel(prompt))


GPT_OSS = HarmonyParser()
