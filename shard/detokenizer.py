"""Token ids back to text, incrementally, with no broken UTF-8, from the model's tokenizer.json.

The shard never tokenizes (the router does, once); it only decodes. Incremental decoding follows
TGI: decode a small window before the new tokens (`prefix_offset:read_offset`) and the same window
with them (`prefix_offset:`); the difference is the new text. Byte-level BPE can end a window in
the middle of a UTF-8 character (decoded as U+FFFD): such text is withheld until the character is
complete. The window also keeps decoders that strip a leading space (SentencePiece) honest.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context of the first generated token's window (TGI uses 5).
PROMPT_CONTEXT = 5


@dataclass(slots=True)
class TextStream:
    """One request's incremental decoding state: the last prompt tokens, then every generated one."""

    ids: list[int]
    prompt_context: int
    prefix_offset: int
    read_offset: int

    @classmethod
    def start(cls, prompt_ids: Sequence[int]) -> TextStream:
        context = list(prompt_ids[-PROMPT_CONTEXT:])
        return cls(
            ids=context, prompt_context=len(context), prefix_offset=0, read_offset=len(context)
        )

    @property
    def generated_ids(self) -> list[int]:
        return self.ids[self.prompt_context :]


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
    ) -> None:
        self.tokenizer = tokenizer
        self.clean_up_spaces = clean_up_spaces
        self.eos_ids = eos_ids
        self.special_ids = frozenset(
            i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special
        )

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> Detokenizer:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: the shard decodes with the model's tokenizer.json"
            )
        tokenizer = Tokenizer.from_file(str(path))
        config = _read_json(model_dir / "tokenizer_config.json")
        clean_up = bool(config.get("clean_up_tokenization_spaces"))
        return cls(tokenizer, clean_up, _eos_token_ids(model_dir, tokenizer, config))

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

    def advance(self, streams: Sequence[TextStream]) -> list[str]:
        """The new text of each stream after its latest token was appended ("" if withheld).

        Two batched decode calls for the whole batch: this runs once per decode step.
        """
        before = self.decode_batch([s.ids[s.prefix_offset : s.read_offset] for s in streams])
        after = self.decode_batch([s.ids[s.prefix_offset :] for s in streams])
        out = []
        for stream, old, new in zip(streams, before, after, strict=True):
            if len(new) > len(old) and not new.endswith(REPLACEMENT_CHAR):
                out.append(new[len(old) :])
                stream.prefix_offset = stream.read_offset
                stream.read_offset = len(stream.ids)
            else:
                out.append("")
        return out


def _eos_token_ids(model_dir: Path, tokenizer: Tokenizer, tokenizer_config: dict) -> frozenset[int]:
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
    return _ids(_read_json(model_dir / "config.json").get("eos_token_id"))


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
