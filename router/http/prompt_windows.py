"""A long prompt's head or tail tokenized instead of all of it.

Tokenizing a prompt near the payload limit (megabytes) takes a worker thread seconds. Two
questions about such a prompt need only a window of it:

- Tail: `truncate` keeps a prompt's last tokens (TGI cuts on the left), so a megabyte prompt
  with `truncate: 10` needs ten tokens, not a megabyte's worth (eight such requests held up
  everyone's validation for seconds). A tail of the text is tokenized, widened until its last
  `keep` tokens are ones the whole text's encoding also ends with.
- Head: whether a prompt is over the token limit, when the tokenizer gives no certain
  characters-per-token bound (token_bound.py): the tokens of a head cut between words are the
  whole prompt's first tokens, so their count is a floor on the prompt's.

Tokenizers split text into pieces at whitespace before their model merges within each piece
(ByteLevel's regex, Metaspace, Whitespace), so a cut changes the tokens of the piece it falls
in, not of the pieces after the next whitespace. A tail is accepted once its kept tokens start
at or after that point ("settled"), and it holds SETTLE_TOKENS more than it keeps (the margin a
text without whitespace relies on, such as CJK text). A tail that never settles (the kept
tokens inside one word longer than the window) is accepted after a few widenings: the tokens
kept are then that word's end as the tail splits it, which is where `truncate` cuts anyway.
A head is cut where a word ends, and SETTLE_TOKENS are taken off its count for the same
margin.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tokenizers import Encoding

# The first window, in characters per kept token: English runs near 4, code and other scripts
# lower; a window too short costs one more (4x wider) try.
TAIL_CHARS_PER_TOKEN = 8
# Tokens beyond the kept ones that the window must hold: the cut piece's own tokens.
SETTLE_TOKENS = 8
# Each retry widens the window this much: the total tokenized stays under 4/3 of the last try.
GROWTH = 4
# After this many widenings a window with enough tokens is accepted even if not settled.
SETTLE_TRIES = 3

# Where a word starts after whitespace: pieces from here on do not depend on what precedes.
_WORD_AFTER_SPACE = re.compile(r"\s(?=\S)")
# Where a word ends before whitespace: pieces up to here do not depend on what follows.
_WORD_BEFORE_SPACE = re.compile(r"(?<=\S)\s")


@dataclass(frozen=True, slots=True)
class Tokenized:
    """The encoding of `text[start:]`: the whole text (start 0) or a tail of it that holds the
    tokens kept. Offsets in `encoding` are relative to `start`."""

    encoding: Encoding
    start: int = 0


def first_window(keep: int) -> int:
    """Characters of the first tail tried for `keep` tokens."""
    return (keep + SETTLE_TOKENS) * TAIL_CHARS_PER_TOKEN


def settled_at(tail: str) -> int | None:
    """The first whitespace before a word, past the tail's first character (a cut falls at 0):
    tokens starting here or later are the whole text's. None when the tail has none."""
    found = _WORD_AFTER_SPACE.search(tail, 1)
    return None if found is None else found.start()


def tail_holds(encoding: Encoding, keep: int, settled: int | None, tries: int) -> bool:
    """True when the tail's last `keep` tokens stand for the whole text's last `keep`."""
    count = len(encoding.ids)
    if count < keep + SETTLE_TOKENS:
        return False
    if settled is None or tries >= SETTLE_TRIES:
        return True
    first = _first_kept_start(encoding, keep)
    return first is None or first >= settled


def _first_kept_start(encoding: Encoding, keep: int) -> int | None:
    """Where the first kept token that stands for text starts; None when every kept token is
    a special one (an appended EOS stands for no text: offsets (0, 0))."""
    special = encoding.special_tokens_mask
    offsets = encoding.offsets
    for i in range(len(offsets) - keep, len(offsets)):
        if not special[i]:
            return int(offsets[i][0])
    return None


def keep_last(encoding: Encoding, keep: int) -> Encoding:
    """TGI's left truncation: the encoding's last `keep` tokens, specials included."""
    if len(encoding.ids) > keep:
        encoding.truncate(keep, direction="left")
    return encoding


def head_words(text: str, chars: int) -> str:
    """The first `chars` characters of a longer `text`, cut back to where a word ends (not cut
    back when the window's second half holds no whitespace)."""
    window = text[:chars]
    ends = [m.start() for m in _WORD_BEFORE_SPACE.finditer(window, len(window) // 2)]
    return window[:ends[-1]] if ends else window


def tokens_at_least(head: Encoding) -> int:
    """A floor on the whole prompt's tokens from its head's encoding: its text tokens (a special
    token the post-processor appends to the head, such as T5's EOS, may not be the prompt's),
    less the margin."""
    return len(head.ids) - sum(head.special_tokens_mask) - SETTLE_TOKENS
