"""Workloads: prompt files, and synthetic prompts aligned to exact lengths by a real tokenizer."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from pytgi_bench.settings import LengthRange
from pytgi_bench.token_aligner import LocalTokenCounter, WordTokenCounter, align_prompt
from pytgi_bench.workload import build_workload, read_prompt_file
from tests.tiny_models import _CORPUS, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(_CORPUS).save(str(path))
    return path


def test_synthetic_prompts_have_the_exact_token_length(tokenizer_file: Path) -> None:
    counter = LocalTokenCounter(tokenizer_file)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    for target in (2, 5, 16, 33, 64, 100):
        text, count = asyncio.run(align_prompt(counter, target, random.Random(target)))
        assert count == target
        assert len(tok.encode(text).ids) == target


def test_build_workload_is_reproducible_and_within_ranges(tokenizer_file: Path) -> None:
    counter = LocalTokenCounter(tokenizer_file)

    def build() -> list[tuple[str, int | None, int]]:
        w = asyncio.run(
            build_workload(12, LengthRange(8, 20), LengthRange(4, 9), counter, None, seed=3)
        )
        assert w.input_lengths_exact and w.length_mismatches == 0
        return [(i.prompt, i.input_tokens, i.max_new_tokens) for i in w.items]

    items = build()
    assert items == build()
    assert all(8 <= n <= 19 and 4 <= m <= 8 for _, n, m in items)  # type: ignore[operator]
    assert len({p for p, _, _ in items}) == 12


def test_prompt_files_in_every_format(tmp_path: Path) -> None:
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a b", "max_new_tokens": 5}\n\n"plain"\n{"inputs": "c"}\n')
    assert read_prompt_file(jsonl) == [("a b", 5), ("plain", None), ("c", None)]
    listed = tmp_path / "p.json"
    listed.write_text(json.dumps([{"text": "x", "output_len": 2}]))
    assert read_prompt_file(listed) == [("x", 2)]
    txt = tmp_path / "p.txt"
    txt.write_text("one\n\ntwo three\n")
    assert read_prompt_file(txt) == [("one", None), ("two three", None)]


def test_file_prompts_cycle_and_keep_their_own_output_length(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a b c", "max_new_tokens": 2}\n{"prompt": "d"}\n')
    w = asyncio.run(
        build_workload(5, LengthRange(1, 2), LengthRange(7, 8), WordTokenCounter(), path, seed=0)
    )
    assert [(i.prompt, i.input_tokens, i.max_new_tokens) for i in w.items] == [
        ("a b c", 3, 2),
        ("d", 1, 7),
        ("a b c", 3, 2),
        ("d", 1, 7),
        ("a b c", 3, 2),
    ]
    assert not w.input_lengths_exact


@pytest.mark.parametrize(
    "content, match",
    [
        ("", "no prompts"),
        ('{"prompt": 3}', "each record"),
        ("[1", "bad.jsonl:1: invalid JSON"),
    ],
)
def test_bad_prompt_files_fail_clearly(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        read_prompt_file(path)
    with pytest.raises(FileNotFoundError, match="prompts file not found"):
        read_prompt_file(tmp_path / "missing.txt")
