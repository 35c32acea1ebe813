"""The character bound on tokens (router/http/token_bound.py) and the Validator's refusal by length:
certain where given, absent where a pipeline can drop characters or fuse them into one token."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from pytgi_router.core.errors import ValidationError
from pytgi_router.http.schemas import parse_generate
from pytgi_router.http.token_bound import max_chars_per_token
from pytgi_router.http.validation import REFUSE_BY_LENGTH_CHARS, ValidationLimits, Validator
from tests.tiny_models import _CORPUS, train_tokenizer

LIMITS = ValidationLimits(
    max_best_of=1, max_stop_sequences=4, max_top_n_tokens=5, max_input_tokens=64,
    max_total_tokens=128,
)
PIECES = ["a", " ", "  ", "é", "東京", "🙂", "\n", "hello world ", "quick brown", "<s>", "</s>",
          "\x00", "\ufffd", "e\u0301"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_tokenizer(_CORPUS)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES) | st.text(max_size=8), min_size=1, max_size=40))
def test_every_prompt_has_at_least_chars_over_the_bound_tokens(
    tokenizer: Tokenizer, parts: list[str]
) -> None:
    per_token = max_chars_per_token(tokenizer)
    assert per_token is not None
    assert per_token == max(len(t) for t in tokenizer.get_vocab(with_added_tokens=True))
    text = "".join(parts)
    tokens = len(tokenizer.encode(text, add_special_tokens=False).ids)
    assert tokens >= math.ceil(len(text) / per_token), text


def unk_bpe(fuse_unk: bool = False) -> Tokenizer:
    return Tokenizer(models.BPE({"a": 0, "<unk>": 1}, [], unk_token="<unk>", fuse_unk=fuse_unk))


def test_no_bound_where_characters_can_vanish_or_fuse() -> None:
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert max_chars_per_token(wordpiece) is None  # one [UNK] per whole word
    assert max_chars_per_token(unk_bpe(fuse_unk=True)) is None  # a run of unknowns, one token
    nfkc = unk_bpe()
    nfkc.normalizer = normalizers.NFKC()  # composes characters: the text can shrink
    assert max_chars_per_token(nfkc) is None
    spaces = unk_bpe()
    spaces.pre_tokenizer = pre_tokenizers.Whitespace()  # drops the spaces
    assert max_chars_per_token(spaces) is None
    no_unk = Tokenizer(models.BPE({"a": 0}, []))  # unknown characters are dropped
    assert max_chars_per_token(no_unk) is None
    truncating = unk_bpe()
    truncating.enable_truncation(8)
    assert max_chars_per_token(truncating) is None


def test_sentencepiece_style_normalizers_keep_the_bound() -> None:
    tok = unk_bpe()
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    assert max_chars_per_token(tok) == len("<unk>")
    tok.normalizer = normalizers.Replace("  ", "▁")  # shorter replacement: can shrink
    assert max_chars_per_token(tok) is None


def refuse(v: Validator, body: dict) -> str:
    with pytest.raises(ValidationError) as info:
        asyncio.run(v.validate(parse_generate(body)))
    return str(info.value)


def test_validator_refuses_by_length_only_when_certain(tokenizer: Tokenizer) -> None:
    v = Validator(tokenizer, LIMITS)
    per_token = v.max_chars_per_token
    assert per_token is not None
    long = "x" * (REFUSE_BY_LENGTH_CHARS + 1)
    at_least = math.ceil(len(long) / per_token)
    assert refuse(v, {"inputs": long}) == (
        f"Input validation error: `inputs` must have less than 64 tokens. Given: at least {at_least}"
    )
    assert f"Given: at least {at_least} `inputs` tokens and 4 `max_new_tokens`" in refuse(
        v, {"inputs": long, "parameters": {"max_new_tokens": 4}}
    )
    # With truncate the prompt's end fits: tokenized, truncated on the left, accepted.
    valid = asyncio.run(v.validate(parse_generate(
        {"inputs": long, "parameters": {"truncate": 10, "max_new_tokens": 4}})))
    assert valid.request.input_ids == tokenizer.encode(long).ids[-10:]
    # A prompt short enough to count exactly gets TGI's exact message.
    short = "x" * REFUSE_BY_LENGTH_CHARS
    exact = len(tokenizer.encode(short).ids)
    assert f"Given: {exact} `inputs` tokens" in refuse(v, {"inputs": short})
