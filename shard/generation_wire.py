"""A decode step's one-token Generations as protobuf wire bytes, parsed into the response at once.

Every decode step answers with one Generation per request. Built through the message API each
costs five calls into upb (add, then an append per repeated field: ~1.3 us), which at batch 256
is the largest share of the step's Python time. Writing the same messages in the protobuf wire
format (varints, packed repeated scalars; stable by the protobuf spec) and parsing them with one
MergeFromString costs ~0.8 us each. The bytes are what the message API serialises, field for
field: tests compare them, and the parsed response is an ordinary message (fields the writer does
not know, like generated_text, are set on it afterwards through the API).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

# Field keys, (number << 3) | wire type; 2 = length-delimited, 0 = varint.
_RESPONSE_GENERATION = b"\x0a"  # DecodeResponse.generations = 1
_GENERATION_REQUEST_ID = b"\x08"  # Generation.request_id = 1
_GENERATION_TOKENS = b"\x1a"  # Generation.tokens = 3
_TOKENS_IDS = b"\x0a"  # Tokens.ids = 1 (packed uint32)
_TOKENS_ONE_LOGPROB = b"\x12\x04"  # Tokens.logprobs = 2 (packed float), one float: 4 bytes
_TOKENS_TEXTS = b"\x1a"  # Tokens.texts = 3
_TOKENS_ONE_IS_SPECIAL = (b"\x22\x01\x00", b"\x22\x01\x01")  # Tokens.is_special = 4 (packed)
_float = struct.Struct("<f").pack


def varint(n: int) -> bytes:
    """Base-128 little-endian varint of an unsigned int (short paths for ids and lengths)."""
    if n < 0x80:
        return _SMALL[n]
    if n < 0x4000:
        return bytes((n & 0x7F | 0x80, n >> 7))
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = tuple(bytes((i,)) for i in range(0x80))


def request_field(request_id: int) -> bytes:
    """A Generation's request_id field (empty for 0, which proto3 leaves out): a batch keeps one
    per request, since its ids do not change from step to step."""
    return _GENERATION_REQUEST_ID + varint(request_id) if request_id else b""


def one_token_generations(
    request_fields: Sequence[bytes],
    ids: Sequence[int],
    logprobs: Sequence[float],
    texts: Sequence[str],
    special: frozenset[int],
) -> bytes:
    """DecodeResponse bytes with, per row, Generation(request_id, tokens=Tokens(ids=[id],
    logprobs=[logprob], texts=[text], is_special=[id in special])), the request_id given as its
    `request_field`."""
    parts: list[bytes] = []
    append = parts.append
    small = _SMALL
    rows = zip(request_fields, ids, logprobs, texts, strict=True)
    for request, token, logprob, text in rows:
        token_bytes = small[token] if token < 0x80 else varint(token)
        text_bytes = text.encode()
        n = len(text_bytes)
        tokens = b"".join(
            (
                _TOKENS_IDS,
                small[len(token_bytes)],
                token_bytes,
                _TOKENS_ONE_LOGPROB,
                _float(logprob),
                _TOKENS_TEXTS,
                small[n] if n < 0x80 else varint(n),
                text_bytes,
                _TOKENS_ONE_IS_SPECIAL[token in special],
            )
        )
        n = len(tokens)
        generation = b"".join(
            (request, _GENERATION_TOKENS, small[n] if n < 0x80 else varint(n), tokens)
        )
        n = len(generation)
        append(_RESPONSE_GENERATION)
        append(small[n] if n < 0x80 else varint(n))
        append(generation)
    return b"".join(parts)
