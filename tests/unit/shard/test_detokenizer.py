"""Incremental detokenization with the tiny models' byte-level BPE tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytgi_shard.detokenizer import REPLACEMENT_CHAR, Detokenizer, TextStream
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
    return Detokenizer.from_model_dir(model_dir)


def stream_texts(detok: Detokenizer, prompt: list[int], generated: list[int]) -> list[str]:
    stream = TextStream.start(prompt)
    out = []
    for token in generated:
        stream.ids.append(token)
        out.extend(detok.advance([stream]))
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
        for i in active:
            streams[i].ids.append((a, b)[i][step])
        for i, text in zip(active, detok.advance([streams[i] for i in active]), strict=True):
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
    tok = Detokenizer.from_model_dir(tmp_path).tokenizer
    eos, pad = tok.token_to_id(EOS), tok.token_to_id(PAD)
    assert Detokenizer.from_model_dir(tmp_path).eos_ids == {eos}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, pad]}))
    assert Detokenizer.from_model_dir(tmp_path).eos_ids == {eos, pad}
    (tmp_path / "generation_config.json").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["eos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": pad}))
    assert Detokenizer.from_model_dir(tmp_path).eos_ids == {pad}


def test_clean_up_tokenization_spaces_when_the_tokenizer_asks(model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text((model_dir / "tokenizer.json").read_text())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    ids = Detokenizer.from_model_dir(model_dir).tokenizer.encode("fox !", add_special_tokens=False).ids
    assert Detokenizer.from_model_dir(model_dir).decode(ids) == "fox !"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**config, "clean_up_tokenization_spaces": True})
    )
    assert Detokenizer.from_model_dir(tmp_path).decode(ids) == "fox!"


def test_missing_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Detokenizer.from_model_dir(tmp_path)
