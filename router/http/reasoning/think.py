"""`<think>…</think>` reasoning (DeepSeek-R1, QwQ, Qwen3), as vLLM's `deepseek_r1` and `qwen3`
parsers read it.

Where the thinking starts depends on the template and the parser:

- the rendered prompt ends with `<think>` (Qwen3-Thinking-2507, DeepSeek-R1-0528's newer
  template): the output is thinking from its first character, and holds only `</think>`;
- the prompt ends with `</think>` (Qwen3 with `enable_thinking: false` renders an empty
  `<think></think>`): the output is all answer;
- otherwise an output that starts with `<think>` (after whitespace) thinks until `</think>`;
  one that does not is, for `deepseek_r1`, thinking anyway until `</think>` (vLLM's rule: R1
  may not write its opening tag), and for `qwen3` all answer (the opening tag is required).

An output cut inside the thinking (max_tokens) is all reasoning: no answer. The answer's
leading whitespace after `</think>` (the models write `</think>\\n\\n`) is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pytgi_router.http.reasoning.pieces import Piece, PieceKind

OPEN = "<think>"
CLOSE = "</think>"

State = Literal["start", "think", "lead", "content"]


def prompt_opens(prompt: str, open_tag: str, close_tag: str) -> bool | None:
    """Whether the prompt's tail left the thinking open (True), closed it (False), or neither
    (None): only its end counts, since earlier turns may hold tags of their own."""
    tail = prompt.rstrip()
    if tail.endswith(open_tag):
        return True
    if tail.endswith(close_tag):
        return False
    return None


def held_prefix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (a tag a later delta may
    complete); 0 when none can (at once when the tag's first character is not in the end:
    the usual token, on the per-token path)."""
    if tag[0] not in text[-(len(tag) - 1):]:
        return 0
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkSplitter:
    """One response read as `<think>` reasoning: a small state machine over the text, holding
    back at most a tag's length of text where a tag may be split across deltas."""

    __slots__ = ("_open", "_close", "_implicit", "_state", "_held")

    def __init__(self, open_tag: str, close_tag: str, start: State, implicit: bool) -> None:
        self._open = open_tag
        self._close = close_tag
        # Whether an output that does not open the tag is thinking anyway.
        self._implicit = implicit
        self._state: State = start
        self._held = ""

    @property
    def thinking(self) -> bool:
        """Inside the thinking, or before the first word of an output that thinks (or that
        has begun its opening tag): the tokens that count as reasoning tokens."""
        if self._state == "start":
            return self._implicit or bool(self._held.strip())
        return self._state == "think"

    def push(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        self._read(text, out)
        return out

    def finish(self) -> list[Piece]:
        """The held text: an unfinished opening tag or a cut-short closing one (reasoning when
        the output was thinking, else answer)."""
        held, self._held = self._held, ""
        if not held or self._state == "lead":
            return []
        kind: PieceKind = "reasoning" if self._state == "think" else "content"
        if self._state == "start":
            kind = "reasoning" if self._implicit else "content"
        return [Piece(kind, held)]

    def _read(self, text: str, out: list[Piece]) -> None:
        """Reads `text` in the current state; a state change reads the rest in the next one."""
        while text:
            if self._state == "content":
                out.append(Piece("content", text))
                return
            if self._state == "lead":
                text = text.lstrip()
                if text:
                    self._state = "content"
                continue
            text = self._think(text, out) if self._state == "think" else self._start(text)

    def _start(self, text: str) -> str:
        """Before the output's first word: is it the opening tag? Returns what is left to read
        in the state decided ("" while undecided)."""
        held = self._held + text
        rest = held.lstrip()
        if not rest or (self._open.startswith(rest) and rest != self._open):
            self._held = held
            return ""
        self._held = ""
        if rest.startswith(self._open):
            self._state = "think"
            return rest[len(self._open):]
        self._state = "think" if self._implicit else "content"
        return held

    def _think(self, text: str, out: list[Piece]) -> str:
        """Reasoning until the closing tag; returns what follows it."""
        held = self._held + text
        at = held.find(self._close)
        if at >= 0:
            self._held = ""
            if at:
                out.append(Piece("reasoning", held[:at]))
            self._state = "lead"
            return held[at + len(self._close):]
        keep = held_prefix(held, self._close)
        self._held = held[len(held) - keep:] if keep else ""
        if len(held) > keep:
            out.append(Piece("reasoning", held[:len(held) - keep]))
        return ""


@dataclass(frozen=True, slots=True)
class ThinkParser:
    """A `<think>`-style parser: its tags, and whether an output that does not open the tag
    thinks anyway (`implicit`, deepseek_r1) or answers (qwen3)."""

    name: str
    implicit: bool
    open_tag: str = OPEN
    close_tag: str = CLOSE

    def reads_special(self, text: str) -> bool:
        """Only the tags (a tokenizer may mark them special); other special tokens, such as
        the end of sequence, are not text."""
        return text in (self.open_tag, self.close_tag)

    def splitter(self, prompt: str) -> ThinkSplitter:
        opened = prompt_opens(prompt, self.open_tag, self.close_tag)
        if opened is False:
            return ThinkSplitter(self.open_tag, self.close_tag, "content", False)
        return ThinkSplitter(self.open_tag, self.close_tag, "start", self.implicit or bool(opened))


DEEPSEEK_R1 = ThinkParser("deepseek_r1", implicit=True)
QWEN3 = ThinkParser("qwen3", implicit=False)
