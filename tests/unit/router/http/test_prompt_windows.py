"""A truncated prompt's kept tokens from a tail of it (router/http/prompt_windows.py,
Validator.encode_tail): the same tokens as the whole prompt's encoding cut on the left, for a
fraction of the tokenizing; and /tokenize's bound (Validator.tokenize)."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Encoding, Tokenizer, models, normalizers, processors, trainers

from pytgi_router.core.errors import ValidationError
from pytgi_router.http.prompt_windows import first_window, head_words, tokens_at_least
from pytgi_router.http.routes_info import tokens_response
from pytgi_router.http.schemas import parse_generate
from pytgi_router.http.validation import REFUSE_BY_LENGTH_CHARS, ValidationLimits, Validator
from tests.tiny_models import _CORPUS, train_tokenizer

LIMITS = ValidationLimits(
    max_best_of=1, max_stop_sequences=4, max_top_n_tokens=5, max_input_tokens=64,
    max_total_tokens=128,
)
WORDS = " ".join(_CORPUS).split() + ["é", "東京", "🙂", "naïve", "x" * 30, "<s>", "\ufffd"]
SEPARATORS = [" ", " ", " ", "  ", "\n", "\n\n", " \t "]


def metaspace_tokenizer() -> Tokenizer:
    """SentencePiece-style (Llama 2): spaces become ▁ in a normalizer, no pre-tokenizer, and
    EOS appended by the post-processor (as T5's)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", tok.token_to_id("</s>"))]
    )
    return tok


TOKENIZERS = {"byte-level": train_tokenizer(_CORPUS), "metaspace+eos": metaspace_tokenizer()}


def unbounded(tokenizer: Tokenizer) -> Tokenizer:
    """The same tokenizer behind an NFC normalizer, which can shrink text: no certain
    characters-per-token bound (token_bound.py), so a long prompt's length proves nothing."""
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.normalizer = normalizers.NFC()
    return copy


class CountingValidator(Validator):
    """Records how many characters each tokenization was given."""

    def __init__(self, tokenizer: Tokenizer, limits: ValidationLimits = LIMITS) -> None:
        super().__init__(tokenizer, limits)
        self.encoded: list[int] = []

    async def encode(self, text: str, add_special_tokens: bool = True) -> Encoding:
        self.encoded.append(len(text))
        return await super().encode(text, add_special_tokens)


def prose(rnd: random.Random, words: int) -> str:
    return "".join(rnd.choice(WORDS) + rnd.choice(SEPARATORS) for _ in range(words))


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), words=st.integers(1, 600), keep=st.integers(1, 64),
       special=st.booleans())
def test_the_tail_keeps_the_whole_prompts_last_tokens(
    name: str, seed: int, words: int, keep: int, special: bool
) -> None:
    tokenizer = TOKENIZERS[name]
    text = prose(random.Random(seed), words)
    whole = tokenizer.encode(text, add_special_tokens=special)
    tail = asyncio.run(Validator(tokenizer, LIMITS).encode_tail(text, special, keep))
    assert tail.encoding.ids == whole.ids[-keep:]
    shifted = [(a + tail.start, b + tail.start) if b else (a, b) for a, b in tail.encoding.offsets]
    assert shifted == whole.offsets[-keep:]


def test_a_megabyte_prompt_with_truncate_tokenizes_only_its_end() -> None:
    v = CountingValidator(TOKENIZERS["byte-level"])
    text = prose(random.Random(0), 200_000)
    valid = asyncio.run(v.validate(parse_generate(
        {"inputs": text, "parameters": {"truncate": 10, "max_new_tokens": 4}})))
    assert valid.request.input_ids == v.tokenizer.encode(text).ids[-10:]
    assert sum(v.encoded) <= first_window(10) * 4, v.encoded
    assert valid.request.inputs == text  # return_full_text shows the prompt as sent


def test_a_tail_with_too_few_tokens_widens_until_the_whole_text() -> None:
    """Long tokens (a run of one character merges into few) need wider tails; a prompt with
    fewer tokens than kept is tokenized whole, exactly."""
    v = CountingValidator(TOKENIZERS["byte-level"])
    text = "The quick brown fox. " + "=" * 5000
    tail = asyncio.run(v.encode_tail(text, True, 60))
    assert tail.encoding.ids == v.tokenizer.encode(text).ids[-60:]
    short = "Hello world"
    assert asyncio.run(v.encode_tail(short, True, 60)).encoding.ids == v.tokenizer.encode(
        short).ids
    assert v.encoded[-1] == len(short)


def test_tokenize_is_bounded_like_a_prompt() -> None:
    tokenizer = TOKENIZERS["byte-level"]
    v = CountingValidator(tokenizer)
    over = " ".join(["hello"] * 200)
    with pytest.raises(ValidationError, match=r"must have less than 64 tokens. Given: \d+"):
        asyncio.run(v.tokenize(over, True, None))
    huge = "x" * 1_000_000  # refused from its length alone, before any tokenizing
    with pytest.raises(ValidationError, match="Given: at least"):
        asyncio.run(v.tokenize(huge, True, None))
    assert len(v.encoded) == 1
    for truncate in (0, 65):
        with pytest.raises(ValidationError, match="`truncate` must be strictly positive"):
            asyncio.run(v.tokenize(over, True, truncate))
    cut = asyncio.run(v.tokenize(over, True, 64))
    assert cut.encoding.ids == tokenizer.encode(over).ids[-64:]
    assert asyncio.run(v.tokenize("", True, None)).encoding.ids == tokenizer.encode("").ids


def test_tokenize_answer_of_a_tail_has_the_whole_inputs_byte_offsets() -> None:
    tokenizer = TOKENIZERS["byte-level"]
    text = prose(random.Random(3), 3000)
    assert not text.isascii()
    whole = tokens_response(text, tokenizer.encode(text)).body
    tail = asyncio.run(Validator(tokenizer, LIMITS).encode_tail(text, True, 40))
    assert tail.start > 0
    cut = tokens_response(text, tail.encoding, start=tail.start).body
    assert json.loads(cut) == json.loads(whole)[-40:]


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), words=st.integers(20, 600),
       fraction=st.floats(0.05, 0.95), special=st.booleans())
def test_a_heads_count_is_a_floor_on_the_whole_prompts(
    name: str, seed: int, words: int, fraction: float, special: bool
) -> None:
    tokenizer = TOKENIZERS[name]
    text = prose(random.Random(seed), words)
    head = head_words(text, int(len(text) * fraction))
    assert text.startswith(head) and len(head) <= len(text) * fraction
    floor = tokens_at_least(tokenizer.encode(head, add_special_tokens=special))
    assert floor <= len(tokenizer.encode(text, add_special_tokens=special).ids)


def test_without_a_certain_bound_a_long_prompt_is_refused_from_its_head() -> None:
    tokenizer = unbounded(TOKENIZERS["byte-level"])
    v = CountingValidator(tokenizer)
    assert v.max_chars_per_token is None
    text = prose(random.Random(1), 200_000)
    with pytest.raises(ValidationError, match="Given: at least") as info:
        asyncio.run(v.validate(parse_generate({"inputs": text, "parameters": {
            "max_new_tokens": 4}})))
    assert "`inputs` tokens + `max_new_tokens` must be <= 128" in info.value.message
    assert v.encoded == [len(head_words(text, first_window(LIMITS.max_input_tokens)))]
    with pytest.raises(ValidationError, match="must have less than 64 tokens. Given: at least"):
        asyncio.run(v.tokenize(text, True, None))
    # Short enough to count exactly: TGI's exact message, after one full tokenization.
    v.encoded.clear()
    short = text[:REFUSE_BY_LENGTH_CHARS]
    with pytest.raises(ValidationError, match=r"Given: \d+ `inputs` tokens"):
        asyncio.run(v.validate(parse_generate({"inputs": short})))
    assert v.encoded == [len(short)]


def test_a_head_that_proves_nothing_leaves_the_exact_count() -> None:
    """Long tokens (one per run of 40 '=', learnt here) make the head's floor too low to refuse:
    the whole prompt is then tokenized and counted exactly."""
    tokenizer = unbounded(train_tokenizer(_CORPUS + ["=" * 40] * 50))
    limits = ValidationLimits(max_best_of=1, max_stop_sequences=4, max_top_n_tokens=5,
                              max_input_tokens=20_000, max_total_tokens=20_010)
    v = CountingValidator(tokenizer, limits)
    text = ("=" * 40 + " ") * 8000  # twice the head window
    exact = len(tokenizer.encode(text).ids)
    valid = asyncio.run(v.validate(parse_generate({"inputs": text, "parameters": {
        "max_new_tokens": 4}})))
    assert valid.request.input_length == exact
    assert v.encoded == [len(head_words(text, first_window(20_000))), len(text)]
