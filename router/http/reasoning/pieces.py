"""What every reasoning parser offers: a `Splitter` per response, fed the output's text a delta
at a time, yielding typed `Piece`s; and the whole-text split, which is that same splitter run
over one delta (one machine, so streamed and unstreamed answers agree by construction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

PieceKind = Literal["reasoning", "content"]


@dataclass(frozen=True, slots=True)
class Piece:
    """A share of the output: thinking ("reasoning") or the answer ("content")."""

    kind: PieceKind
    text: str


class Splitter(Protocol):
    """One response's output read as it streams. `push` takes the next delta of text (a tag
    may end in a later delta: what could still be one is held back); `finish` releases what
    was held once the output ended. `thinking` says whether the text read so far is inside
    the thinking, which is how reasoning tokens are counted."""

    @property
    def thinking(self) -> bool: ...

    def push(self, text: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...


class ReasoningParser(Protocol):
    """A model family's reasoning format. `reads_special(text)`: whether a special token of
    this text must be fed to the splitter (gpt-oss's markers are special tokens, and a
    tokenizer may mark `<think>` special) although the answer omits special tokens.
    `splitter(prompt)`: the rendered prompt says whether the template already opened (or
    closed) the thinking."""

    @property
    def name(self) -> str: ...

    def reads_special(self, text: str) -> bool: ...

    def splitter(self, prompt: str) -> Splitter: ...


@dataclass(frozen=True, slots=True)
class Split:
    """A whole output split: None where the output had no such part."""

    reasoning: str | None
    content: str | None


def joined(pieces: list[Piece]) -> Split:
    """Pieces joined by kind (None for a kind none of them had)."""
    reasoning = [p.text for p in pieces if p.kind == "reasoning"]
    content = [p.text for p in pieces if p.kind == "content"]
    return Split("".join(reasoning) if reasoning else None, "".join(content) if content else None)


def split_text(parser: ReasoningParser, text: str, prompt: str = "") -> Split:
    """The whole-text split: the parser's own splitter run over `text` in one delta."""
    splitter = parser.splitter(prompt)
    return joined([*splitter.push(text), *splitter.finish()])
