"""The most characters of input one token can stand for, when the tokenizer makes that certain.

Tokenizing a prompt near the payload limit (megabytes) takes seconds of a worker thread. When
one token can cover at most `M` characters, a prompt of `n` characters has at least ceil(n / M)
tokens, so a prompt that cannot fit the token limits is refused from its length alone, before
any tokenizing. That lower bound holds only when nothing in the pipeline can make characters
vanish or let one token swallow an unbounded run of them, so the bound is given only for the
pipelines where every step is known to keep or grow the text:

- the model is BPE, and every character reaches a token: byte-level with all 256 bytes in the
  vocabulary, byte fallback, or an unknown token that is not fused (`fuse_unk` merges a whole
  run of unknown characters into one token);
- normalizers only prepend, or replace a literal string by one at least as long (Unicode
  normalization and stripping can shrink the text);
- pre-tokenizers only split and keep every character (Whitespace and Bert drop spaces);
- no added token strips whitespace around itself, and the tokenizer itself does not truncate.

A token's vocabulary string is never shorter than the characters it covers: byte-level symbols
are one per byte (a character is at least one byte), `▁` stands for one space, `<0x41>` for one
byte. So M is the longest vocabulary or added-token string.
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers import Tokenizer, pre_tokenizers

KEEPING_NORMALIZERS = frozenset({"Prepend", "Replace", "Sequence"})
KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation",
                                    "Sequence"})


def max_chars_per_token(tokenizer: Tokenizer) -> int | None:
    """M such that every token covers at most M input characters, or None when not certain."""
    if tokenizer.truncation is not None:
        return None
    spec: dict[str, Any] = json.loads(tokenizer.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("fuse_unk"):
        return None
    if not _keeps_characters(spec.get("normalizer"), _normalizer_keeps):
        return None
    pre = spec.get("pre_tokenizer")
    if not _keeps_characters(pre, _pre_tokenizer_keeps):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []):
        return None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    if not _every_character_reaches_a_token(model, pre, vocab):
        return None
    return max((len(token) for token in vocab), default=0) or None


def _keeps_characters(node: dict[str, Any] | None, keeps: Any) -> bool:
    """True when the component (or every member of a Sequence) is known to keep every character."""
    if node is None:
        return True
    members = node.get("normalizers") or node.get("pretokenizers")
    if node.get("type") == "Sequence":
        return all(_keeps_characters(m, keeps) for m in members or [])
    return bool(keeps(node))


def _normalizer_keeps(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    if kind not in KEEPING_NORMALIZERS:
        return False
    if kind == "Replace":
        pattern = node.get("pattern") or {}
        literal = pattern.get("String")
        return isinstance(literal, str) and len(node.get("content", "")) >= len(literal)
    return True


def _pre_tokenizer_keeps(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    if kind not in KEEPING_PRE_TOKENIZERS:
        return False
    return node.get("behavior") != "Removed"


def _has_byte_level(node: dict[str, Any] | None) -> bool:
    if node is None:
        return False
    if node.get("type") == "Sequence":
        return any(_has_byte_level(m) for m in node.get("pretokenizers") or [])
    return node.get("type") == "ByteLevel"


def _every_character_reaches_a_token(
    model: dict[str, Any], pre: dict[str, Any] | None, vocab: dict[str, int]
) -> bool:
    """BPE drops characters it has no token for unless bytes or an unknown token catch them."""
    if model.get("byte_fallback") or model.get("unk_token") is not None:
        return True
    if _has_byte_level(pre):
        return all(symbol in vocab for symbol in pre_tokenizers.ByteLevel.alphabet())
    return False
