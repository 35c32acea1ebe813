"""Incremental detokenization with the tiny models' byte-level BPE tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pytgi_shard.output.detokenizer import REPLACEMENT_CHAR, Detokenizer, TextStream, TextStreams
from tests.tiny_models import BOS, EOS, PAD, train_tokenizer, write_tokenizer

TEXT = "Unicode: café, naïve, 東京, Привет, ✓, 🙂 emoji. The quick brown fox!"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    tok = train_tokenizer(["The quick brown fox jumps over the lazy dog.", "Hello world!"])
    write_tokenizer(path, tok, 256)
    return path


@pytest.fixture(scope="module")
def detok(model_dir: Path) -> Detokenizer:
    return Detokenizer.from_model_dir(model_dir, {})


def stream_texts(detok: Detokenizer, prompt: list[int], generated: list[int]) -> list[str]:
    streams = TextStreams([TextStream.start(prompt)])
    out = []
    for token in generated:
        out.extend(detok.advance(streams, [token]))
    return out


def test_increments_add_up_to_the_full_text_without_broken_characters(detok: Detokenizer) -> None:
    ids = detok.tokenizer.encode(TEXT, add_special_tokens=False).ids
    # Rare characters fall back to single bytes: some tokens end inside a UTF-8 character.
    assert any(REPLACEMENT_CHAR in detok.decode([i]) for i in ids)
    prompt = detok.tokenizer.encode("Hello world", add_special_tokens=False).ids
    texts = stream_texts(detok, prompt, ids)
    assert "".join(texts) == TEXT
    assert all(REPLACEMENT_CHAR not in t for t in texts)
    assert "" in texts


def test_batched_streams_advance_independently(detok: Detokenizer) -> None:
    a = detok.tokenizer.encode("🙂 fox", add_special_tokens=False).ids
    b = detok.tokenizer.encode("The dog", add_special_tokens=False).ids
    streams = [TextStream.start([1]), TextStream.start([])]
    pieces: list[list[str]] = [[], []]
    for step in range(max(len(a), len(b))):
        active = [i for i, seq in enumerate((a, b)) if step < len(seq)]
        tokens = [(a, b)[i][step] for i in active]
        batch = TextStreams([streams[i] for i in active])
        for i, text in zip(active, detok.advance(batch, tokens), strict=True):
            pieces[i].append(text)
    assert ["".join(p) for p in pieces] == ["🙂 fox", "The dog"]
    assert streams[0].generated_ids == a and streams[1].generated_ids == b


def test_special_tokens_are_flagged_and_skipped_in_the_final_text(detok: Detokenizer) -> None:
    eos = detok.tokenizer.token_to_id(EOS)
    ids = [*detok.tokenizer.encode("fox", add_special_tokens=False).ids, eos]
    assert eos in detok.special_ids and detok.tokenizer.token_to_id(BOS) in detok.special_ids
    assert detok.decode(ids, skip_special_tokens=True) == "fox"
    assert stream_texts(detok, [], ids)[-1] == EOS
    assert detok.token_texts(ids[-1:]) == [EOS]


def test_eos_ids_come_from_generation_config_then_tokenizer_then_config(
    model_dir: Path, tmp_path: Path
) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((model_dir / name).read_text())
    tok = Detokenizer.from_model_dir(tmp_path, {}).tokenizer
    eos, pad = tok.token_to_id(EOS), tok.token_to_id(PAD)
    assert Detokenizer.from_model_dir(tmp_path, {}).eos_ids == {eos}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, pad]}))
    assert Detokenizer.from_model_dir(tmp_path, {}).eos_ids == {eos, pad}
    (tmp_path / "generation_config.json").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["eos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Detokenizer.from_model_dir(tmp_path, {"eos_token_id": pad}).eos_ids == {pad}


def test_clean_up_tokenization_spaces_when_the_tokenizer_asks(
    model_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "tokenizer.json").write_text((model_dir / "tokenizer.json").read_text())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    ids = (
        Detokenizer.from_model_dir(model_dir, {})
        .tokenizer.encode("fox !", add_special_tokens=False)
        .ids
    )
    assert Detokenizer.from_model_dir(model_dir, {}).decode(ids) == "fox !"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**config, "clean_up_tokenization_spaces": True})
    )
    assert Detokenizer.from_model_dir(tmp_path, {}).decode(ids) == "fox!"


def test_missing_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Detokenizer.from_model_dir(tmp_path, {})


@pytest.fixture(scope="module")
def reference(detok: Detokenizer) -> Detokenizer:
    return Detokenizer(detok.tokenizer, piece_table=False)


def steps_of(detok: Detokenizer, prompts: list[list[int]], tokens: list[list[int]]) -> list:
    """Advances one stream per prompt in one batch, a token per step while it has any (the
    batch is rebuilt, as a filter does, when a stream has no more); returns every step's texts
    and the streams' offsets after each step."""
    streams = [TextStream.start(p) for p in prompts]
    out = []
    batch, active = TextStreams([]), list[int]()
    for step in range(max(len(t) for t in tokens)):
        if active != (active := [i for i, t in enumerate(tokens) if step < len(t)]):
            batch = TextStreams([streams[i] for i in active])
        new = [tokens[i][step] for i in active]
        out.append(detok.advance(batch, new))
        out.append([(s.prefix_offset, s.read_offset, s.generated_ids) for s in streams])
    return out


def test_byte_level_tokenizers_get_a_table_of_whole_utf8_pieces(detok: Detokenizer) -> None:
    pieces = detok.plain_pieces
    assert len(pieces) == detok.tokenizer.get_vocab_size(with_added_tokens=True)
    (fox,) = detok.tokenizer.encode(" fox", add_special_tokens=False).ids
    assert pieces[fox] == " fox"
    # Added tokens and bytes that end inside a character are left to the window step.
    assert all(pieces[i] is None for i in detok.special_ids)
    assert any(p is None for i, p in enumerate(pieces) if i not in detok.special_ids)


# Tokens of text with multi-byte characters split into byte tokens, or any ids at all (special
# tokens, and bytes that start or continue a character with no end in sight, included).
_TEXTS = st.text(alphabet="ab é東🙂\n!", max_size=12)
_IDS = st.lists(st.integers(0, 300), max_size=6)


@settings(max_examples=150, deadline=None)
@given(
    prompts=st.lists(st.one_of(_TEXTS, _IDS), min_size=1, max_size=4),
    generated=st.lists(st.one_of(_TEXTS, _IDS), min_size=4, max_size=4),
)
def test_piece_table_gives_the_window_steps_texts_and_offsets(
    detok: Detokenizer, reference: Detokenizer, prompts: list, generated: list
) -> None:
    def ids(x: str | list[int]) -> list[int]:
        return detok.tokenizer.encode(x, add_special_tokens=False).ids if isinstance(x, str) else x

    prompt_ids = [ids(p) for p in prompts]
    token_ids = [ids(g) + [5] for g in generated[: len(prompts)]]
    assert steps_of(detok, prompt_ids, token_ids) == steps_of(reference, prompt_ids, token_ids)


def test_a_withheld_byte_is_not_lost_by_the_next_plain_token(
    detok: Detokenizer, reference: Detokenizer
) -> None:
    (a,), (b,) = (detok.tokenizer.encode(c, add_special_tokens=False).ids for c in "ab")
    lead = detok.tokenizer.encode("東", add_special_tokens=False).ids[0]
    tokens = [[a, lead, b, a]]
    texts = [["a"], [""], [REPLACEMENT_CHAR + "b"], ["a"]]
    offsets = [(0, 1), (0, 1), (1, 3), (3, 4)]
    expected: list = []
    for step, (text, (prefix, read)) in enumerate(zip(texts, offsets, strict=True)):
        expected += [text, [(prefix, read, tokens[0][: step + 1])]]
    assert steps_of(reference, [[]], tokens) == expected
    assert steps_of(detok, [[]], tokens) == expected


def test_plain_tokens_are_not_decoded(detok: Detokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    decode_batch = detok.decode_batch
    monkeypatch.setattr(detok, "decode_batch", lambda b: calls.append(b) or decode_batch(b))
    ids = detok.tokenizer.encode("The quick brown fox", add_special_tokens=False).ids
    texts = stream_texts(detok, [1, 2], ids)
    assert "".join(texts) == "The quick brown fox"
    # The prompt's window is decoded at the first step only.
    assert len(calls) == 2


def test_other_decoders_and_clean_up_always_decode_windows(model_dir: Path) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(["hello world, the quick fox"] * 4, trainers.BpeTrainer(vocab_size=60))
    metaspace = Detokenizer(tok)
    assert metaspace.plain_pieces == ()
    ids = tok.encode("the quick fox").ids
    # The window keeps the space that decoding "quick" alone would strip.
    assert "".join(stream_texts(metaspace, ids[:1], ids[1:])) == " quick fox"
    byte_level = Detokenizer.from_model_dir(model_dir, {}).tokenizer
    assert Detokenizer(byte_level, clean_up_spaces=True).plain_pieces == ()
