"""compare.py's pieces that need no server: the EOS-free model builder and the ratio table."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from pytgi_bench.compare.model_builder import LlamaShape, build_random_llama, is_checkpoint
from pytgi_bench.compare.system_result import SystemResult
from pytgi_bench.compare.table import check_targets, print_table, ratio

TINY = LlamaShape("unit-tiny", 32, 64, 1, 2, 1, vocab_size=1100, max_position_embeddings=128)


def test_random_llama_is_a_real_checkpoint_that_never_emits_eos(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = build_random_llama(tmp_path / "m", TINY, None)
    assert is_checkpoint(path)
    config = json.loads((path / "config.json").read_text())
    assert (config["hidden_size"], config["vocab_size"]) == (32, 1100)
    model = AutoModelForCausalLM.from_pretrained(path)
    eos = config["eos_token_id"]
    head = model.get_output_embeddings().weight
    # The trained tokenizer has 1024 ids; ids past it and EOS have all-zero head rows.
    assert not head[eos].any() and not head[1024:].any() and head[:eos].any()
    prompt = torch.tensor([[0, 5, 9, 200, 7]])
    out = model.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=2)
    generated = out[0, prompt.shape[1] :].tolist()
    assert len(generated) == 40 and eos not in generated and max(generated) < 1024
    # A second build with the same spec reuses the directory.
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    build_random_llama(tmp_path / "m", TINY, None)
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def _result(system: str, tok_s: float | None, error: str | None = None) -> SystemResult:
    if tok_s is None:
        return SystemResult.not_available(system, "refused", error or "no")
    return SystemResult(
        system,
        system,
        wall_s=[1.0, 2.0, 4.0],
        output_tokens=[int(tok_s), int(2 * tok_s), int(4 * tok_s)],
    )


def test_ratios_and_targets_use_median_throughput() -> None:
    results = [
        _result("hf-sequential", 100),
        _result("hf-static", 1000),
        _result("hf-cb", None, "TypeError: cpu"),
        _result("hf-cb-cpu-patched", 500),
        _result("pytgi-inprocess", 1000),
        _result("pytgi-http", 900),
    ]
    assert results[0].tokens_per_s == pytest.approx(100)
    assert results[0].median_wall_s == 2.0
    assert ratio(results, "pytgi-http", "hf-sequential") == pytest.approx(9.0)
    assert ratio(results, "pytgi-http", "hf-cb") is None
    checks = {c.against: c for c in check_targets(results)}
    assert checks["hf-sequential"].passed is True
    assert checks["hf-static"].passed is True and checks["hf-static"].ratio == pytest.approx(0.9)
    # hf-cb is N/A on CPU: the patched row stands in.
    assert checks["hf-cb-cpu-patched"].passed is True
    assert checks["pytgi-inprocess"].passed is True
    results[-1] = _result("pytgi-http", 800)
    assert {c.against: c.passed for c in check_targets(results)}["pytgi-inprocess"] is False
    table = io.StringIO()
    print_table(results, 100, table)
    text = table.getvalue()
    assert "N/A: TypeError: cpu" in text and "MISS  end-to-end within 15%" in text
    assert "[TOKENS [100, 200, 400] != 100]" in text
