"""Synthetic prompts of an exact token length, measured by the server's own tokenizer.

TGI's API takes text, so a prompt of N tokens is built the way vLLM's benchmark does it: random
words, tokenized by the server (`/tokenize`) or a local tokenizer.json, cut at the end of the N-th
token and re-checked, because re-tokenizing a cut text can merge differently at the cut.
"""

from __future__ import annotations

import random
import re
import string
from pathlib import Path
from typing import Protocol

import httpx

Offsets = list[tuple[int, int]]

# Words are plain ASCII so byte offsets (TGI) and character offsets (tokenizers) coincide.
_LETTERS = string.ascii_lowercase
_MAX_ROUNDS = 8


class TokenCounter(Protocol):
    # False when lengths are only estimated (no tokenizer reachable).
    exact: bool

    async def offsets(self, text: str) -> Offsets:
        """(start, stop) of every token the server would count, special tokens included."""
        ...


class ServerTokenCounter:
    """Counts with the endpoint's `/tokenize` (TGI shape: [{"id","text","start","stop"}])."""

    exact = True

    def __init__(self, http: httpx.AsyncClient, url: str) -> None:
        self._http = http
        self._url = f"{url}/tokenize"

    async def offsets(self, text: str) -> Offsets:
        response = await self._http.post(self._url, json={"inputs": text})
        if response.status_code == 422 and "tokens" in response.text:
            # pytgi (like a prompt) refuses to tokenize past --max-input-tokens.
            raise PromptTooLong(response.json().get("error", response.text))
        response.raise_for_status()
        return [(int(t["start"]), int(t["stop"])) for t in response.json()]


class PromptTooLong(Exception):
    """The server refused to count a text longer than its input limit."""


class LocalTokenCounter:
    """Counts with a local tokenizer.json (the model directory or the file itself)."""

    exact = True

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self._tokenizer = Tokenizer.from_file(str(file))

    async def offsets(self, text: str) -> Offsets:
        return list(self._tokenizer.encode(text).offsets)


class WordTokenCounter:
    """One token per whitespace-separated word: an estimate for endpoints without /tokenize."""

    exact = False

    async def offsets(self, text: str) -> Offsets:
        return [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]


async def server_counter_or_none(http: httpx.AsyncClient, url: str) -> ServerTokenCounter | None:
    """The server's /tokenize when it answers in TGI's shape, else None."""
    counter = ServerTokenCounter(http, url)
    try:
        probe = await counter.offsets("hello world")
    except (httpx.HTTPStatusError, ValueError, KeyError, TypeError):
        return None
    return counter if probe else None


def random_words(rng: random.Random, count: int) -> str:
    return " ".join(
        "".join(rng.choices(_LETTERS, k=rng.randint(2, 7))) for _ in range(max(count, 1))
    )


async def align_prompt(counter: TokenCounter, target: int, rng: random.Random) -> tuple[str, int]:
    """Random text that `counter` tokenizes to `target` tokens; returns (text, actual count).

    The count can miss the target by a token or two for tokenizers whose merges are unstable at
    the cut; the caller records the actual count rather than trusting the target.
    """
    text = random_words(rng, target)
    count = await _count(counter, text)
    for _ in range(_MAX_ROUNDS):
        if count == target:
            break
        if count < 0:
            # Over the server's input limit: halve by words and count again.
            text = text[: max(text.rfind(" ", 0, len(text) // 2), 1)]
        elif count < target:
            text = f"{text} {random_words(rng, target - count)}"
        else:
            offsets = await counter.offsets(text)
            # Special tokens (BOS) have empty spans; the cut goes after the last real one wanted.
            stop = max((end for _, end in offsets[:target]), default=0)
            if stop == 0:
                break
            text = text[:stop]
        count = await _count(counter, text)
    if count < 0:
        raise ValueError(f"no prompt of {target} tokens fits the server's input limit")
    return text, count


async def _count(counter: TokenCounter, text: str) -> int:
    """The number of tokens of `text`; -1 when the server refuses it as over its input limit."""
    try:
        return len(await counter.offsets(text))
    except PromptTooLong:
        return -1
