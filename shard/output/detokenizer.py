"""Token ids back to text, incrementally, with no broken UTF-8, from the model's tokenizer.json.

The shard never tokenizes (the router does, once); it only decodes. Incremental decoding follows
TGI: decode a small window before the new tokens (`prefix_offset:read_offset`) and the same window
with them (`prefix_offset:`); the difference is the new text. Byte-level BPE can end a window in
the middle of a UTF-8 character (decoded as U+FFFD): such text is withheld until the character is
complete. The window also keeps decoders that strip a leading space (SentencePiece) honest.

A decode step advances every request, so the windows are the shard's per-token hot path. For
byte-level decoders (GPT-2, Llama 3, Qwen: each token is a fixed byte string, the text is the
UTF-8 of their concatenation) a window of one plain token whose bytes are whole UTF-8 followed by
one more such token always yields exactly that token's own text: `advance` then reads it from a
table built once, and decodes windows only for the other streams (see `_plain_pieces`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from tokenizers import Tokenizer, decoders

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context of the first generated token's window (TGI uses 5).
PROMPT_CONTEXT = 5


@dataclass(slots=True)
class TextStream:
    """One request's incremental decoding state: the last prompt tokens, then every generated one."""

    ids: list[int]
    prompt_context: int
    # The window ids[prefix_offset:read_offset] (TGI's offsets), kept here while not `plain`.
    _prefix: int
    _read: int
    # The window is the last id alone, a token with a plain piece, and every id is read: the
    # offsets are len(ids) - 1 and len(ids) then, so that a plain step (Detokenizer.advance)
    # only appends its token.
    plain: bool = False

    @classmethod
    def start(cls, prompt_ids: Sequence[int], generated_ids: Sequence[int] = ()) -> TextStream:
        """The stream of a new request; `generated_ids` (a request resumed after preemption)
        count as generated but are not read yet: Detokenizer.catch_up reads them."""
        context = list(prompt_ids[-PROMPT_CONTEXT:])
        return cls([*context, *generated_ids], len(context), 0, len(context))

    @property
    def prefix_offset(self) -> int:
        return len(self.ids) - 1 if self.plain else self._prefix

    @property
    def read_offset(self) -> int:
        return len(self.ids) if self.plain else self._read

    def leave_plain(self) -> None:
        """Makes the offsets explicit before a token that is not plain is appended."""
        if self.plain:
            self._prefix, self._read, self.plain = len(self.ids) - 1, len(self.ids), False

    def read_window(self, plain: bool) -> None:
        """The window moves on to the tokens just read (their text was emitted); `plain`: it is
        one plain token."""
        self._prefix, self._read, self.plain = self._read, len(self.ids), plain

    @property
    def generated_ids(self) -> list[int]:
        return self.ids[self.prompt_context :]

    @property
    def generated(self) -> int:
        """How many tokens were generated (every one is appended here)."""
        return len(self.ids) - self.prompt_context


class TextStreams:
    """A batch's text streams in row order, with what each step reads at hand: every stream's
    ids list (one append each) and the rows whose window is not plain (decoded by windows).

    Those rows are found at the first step (a resumed request's catch_up may have run since the
    batch was built); from then on the batch's steps are the only ones to advance its streams.
    """

    __slots__ = ("streams", "ids", "windowed")

    def __init__(self, streams: Sequence[TextStream]) -> None:
        self.streams = list(streams)
        self.ids = [s.ids for s in self.streams]
        self.windowed: list[int] | None = None

    def __len__(self) -> int:
        return len(self.streams)


def clean_up_tokenization(text: str) -> str:
    """transformers' legacy clean-up of spaces before punctuation, for tokenizers that ask for it."""
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )


class Detokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        clean_up_spaces: bool = False,
        eos_ids: frozenset[int] = frozenset(),
        piece_table: bool = True,
    ) -> None:
        """piece_table=False always decodes windows: the reference the table is tested against."""
        self.tokenizer = tokenizer
        self.clean_up_spaces = clean_up_spaces
        self.eos_ids = eos_ids
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, token in added.items() if token.special)
        self.plain_pieces = (
            _plain_pieces(tokenizer, frozenset(added))
            if piece_table
            and isinstance(tokenizer.decoder, decoders.ByteLevel)
            and not clean_up_spaces
            else ()
        )

    @classmethod
    def from_model_dir(cls, model_dir: Path, model_config: Mapping[str, Any]) -> Detokenizer:
        """The tokenizer files of `model_dir`; `model_config` is its config.json as start-up
        read it (its eos_token_id is the last EOS fallback)."""
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: the shard decodes with the model's tokenizer.json"
            )
        tokenizer = Tokenizer.from_file(str(path))
        config = _read_json(model_dir / "tokenizer_config.json")
        clean_up = bool(config.get("clean_up_tokenization_spaces"))
        eos_ids = _eos_token_ids(model_dir, tokenizer, config, model_config)
        return cls(tokenizer, clean_up, eos_ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.clean_up_spaces else text

    def decode_batch(
        self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = False
    ) -> list[str]:
        texts = self.tokenizer.decode_batch([list(ids) for ids in batch], skip_special_tokens)
        return [clean_up_tokenization(t) for t in texts] if self.clean_up_spaces else texts

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each token decoded on its own (prefill and top tokens, as TGI reports them)."""
        return self.decode_batch([[i] for i in ids])

    def advance(self, streams: TextStreams, tokens: Sequence[int]) -> list[str]:
        """Appends tokens[i] to the i-th stream; returns the new text of each ("" if withheld).

        A plain stream (its window one plain token) that got a plain token reads that token's
        piece (exactly what decoding the two windows gives, see `_plain_pieces`) and stays
        plain, with nothing of its own to update; the others decode their windows in two batched
        calls.
        """
        pieces = self.plain_pieces
        known = len(pieces)
        texts: list[str | None] = [pieces[t] if 0 <= t < known else None for t in tokens]
        rows = streams.windowed
        if rows is None:
            rows = [row for row, s in enumerate(streams.streams) if not s.plain]
        if None in texts:
            rows = sorted({*rows, *(row for row, text in enumerate(texts) if text is None)})
        for row in rows:
            streams.streams[row].leave_plain()
            texts[row] = ""
        for ids, token in zip(streams.ids, tokens, strict=True):
            ids.append(token)
        out = cast(list[str], texts)
        if rows:
            self._advance_windows([streams.streams[row] for row in rows], rows, out)
        streams.windowed = [row for row in rows if not streams.streams[row].plain]
        return out

    def _advance_windows(
        self, streams: Sequence[TextStream], rows: Sequence[int], out: list[str]
    ) -> None:
        """TGI's two-window step for `streams` (none plain), writing each new text to
        `out[rows[i]]`."""
        before = self.decode_batch([s.ids[s.prefix_offset : s.read_offset] for s in streams])
        after = self.decode_batch([s.ids[s.prefix_offset :] for s in streams])
        for row, stream, old, new in zip(rows, streams, before, after, strict=True):
            if len(new) > len(old) and not new.endswith(REPLACEMENT_CHAR):
                out[row] = new[len(old) :]
                read = stream.read_offset
                stream.read_window(
                    len(stream.ids) - read == 1 and self.piece(stream.ids[read]) is not None
                )

    def catch_up(self, stream: TextStream) -> str:
        """Reads the tokens appended to `stream` but not read yet (a resumed request's
        generated_ids) one at a time, as the steps that generated them did: the offsets end
        where those steps left them, so the next token's text continues after theirs (a
        character they left incomplete included) and nothing is emitted twice. Returns their
        text (what the stop sequences have seen)."""
        pending = stream.ids[stream.read_offset :]
        del stream.ids[stream.read_offset :]
        alone = TextStreams([stream])
        return "".join(self.advance(alone, [token])[0] for token in pending)

    def piece(self, token: int) -> str | None:
        """The token's own text when it can be appended as is (see `_plain_pieces`), else None."""
        pieces = self.plain_pieces
        return pieces[token] if 0 <= token < len(pieces) else None


def _plain_pieces(tokenizer: Tokenizer, added: frozenset[int]) -> tuple[str | None, ...]:
    """Per token id, its own text when that text can be appended as is; else None.

    With a byte-level decoder, decode(ids) is the lossy UTF-8 decoding of the concatenated bytes
    of the tokens. When the bytes of token a and of token b are each whole UTF-8 (their text has
    no U+FFFD), decode([a, b]) == decode([a]) + decode([b]), so TGI's window step from window [a]
    to [a, b] emits exactly decode([b]) (non-empty, not ending in U+FFFD). Added tokens (decoded
    from their content, not their bytes) and empty texts are left to the window step.
    """
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    return tuple(
        None if i in added or not text or REPLACEMENT_CHAR in text else text
        for i, text in enumerate(texts)
    )


def _eos_token_ids(
    model_dir: Path,
    tokenizer: Tokenizer,
    tokenizer_config: dict,
    model_config: Mapping[str, Any],
) -> frozenset[int]:
    """generation_config.json's eos_token_id (an id or a list), else the tokenizer's EOS token,
    else config.json's eos_token_id."""
    generation = _read_json(model_dir / "generation_config.json").get("eos_token_id")
    if generation is not None:
        return _ids(generation)
    token = tokenizer_config.get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str) and (found := tokenizer.token_to_id(token)) is not None:
        return frozenset({found})
    return _ids(model_config.get("eos_token_id"))


def _ids(value: object) -> frozenset[int]:
    if isinstance(value, int):
        return frozenset({value})
    if isinstance(value, list):
        return frozenset(v for v in value if isinstance(v, int))
    return frozenset()


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}
