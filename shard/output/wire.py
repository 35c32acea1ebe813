"""A decode step's one-token Generations as protobuf wire bytes, parsed into the response at once.

Every decode step answers with one Generation per request. Built through the message API each
costs five calls into upb (add, then an append per repeated field: ~1.3 us), which at batch 256
is the largest share of the step's Python time. Writing the same messages in the protobuf wire
format (varints, packed repeated scalars; stable by the protobuf spec) and parsing them with one
MergeFromString costs ~0.8 us each, ~0.2 us once each token's bytes are kept (GenerationWriter).
The bytes are what the message API serialises, field for field: tests compare them, and the
parsed response is an ordinary message (fields the writer does not know, like generated_text,
are set on it afterwards through the API).
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


class GenerationWriter:
    """Writes a decode step's one-token Generations, keeping per token id the bytes of its
    Tokens message around the logprob (for the text it came with last): most steps emit tokens
    seen before, with the same text (every plain token of a byte-level tokenizer always has its
    own), so a row costs a lookup and one six-part extend instead of encoding its text and
    joining eleven parts. A row whose text differs from the kept one replaces it.

    One per engine: the kept bytes depend only on the vocabulary and the special ids.
    """

    def __init__(self, special: frozenset[int]) -> None:
        self.special = special
        # token -> (text, bytes before the logprob, bytes after it, Generation bytes without
        # its request_id field).
        self._fields: dict[int, tuple[str, bytes, bytes, int]] = {}

    def one_token_generations(
        self,
        request_fields: Sequence[bytes],
        ids: Sequence[int],
        logprobs: Sequence[float],
        texts: Sequence[str],
    ) -> bytes:
        """DecodeResponse bytes with, per row, Generation(request_id, tokens=Tokens(ids=[id],
        logprobs=[logprob], texts=[text], is_special=[id in special])), the request_id given as
        its `request_field`."""
        parts: list[bytes] = []
        extend = parts.extend
        kept = self._fields
        get = kept.get
        small = _SMALL
        pack = _float
        for request, token, logprob, text in zip(request_fields, ids, logprobs, texts, strict=True):
            fields = get(token)
            if fields is None or fields[0] != text:
                fields = kept[token] = self._token_fields(token, text)
            _, before, after, size = fields
            n = len(request) + size
            extend(
                (
                    _RESPONSE_GENERATION,
                    small[n] if n < 0x80 else varint(n),
                    request,
                    before,
                    pack(logprob),
                    after,
                )
            )
        return b"".join(parts)

    def _token_fields(self, token: int, text: str) -> tuple[str, bytes, bytes, int]:
        """The Generation's tokens field up to its logprob's 4 bytes, and after them."""
        token_bytes = varint(token)
        text_bytes = text.encode()
        ids = b"".join((_TOKENS_IDS, varint(len(token_bytes)), token_bytes, _TOKENS_ONE_LOGPROB))
        after = b"".join(
            (
                _TOKENS_TEXTS,
                varint(len(text_bytes)),
                text_bytes,
                _TOKENS_ONE_IS_SPECIAL[token in self.special],
            )
        )
        before = b"".join((_GENERATION_TOKENS, varint(len(ids) + 4 + len(after)), ids))
        return text, before, after, len(before) + 4 + len(after)
