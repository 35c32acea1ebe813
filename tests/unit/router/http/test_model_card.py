"""model_card: the Hub revision from an HF cache snapshot path, the pipeline tag from config.json."""

from __future__ import annotations

from pathlib import Path

from pytgi_router.http.model_files import pipeline_tag, snapshot_sha

SHA = "a" * 40


def test_snapshot_sha_only_for_a_commit_folder_of_the_hf_cache(tmp_path: Path) -> None:
    cached = tmp_path / "hub" / "models--org--name" / "snapshots" / SHA / "tokenizer.json"
    assert snapshot_sha(cached) == SHA
    assert snapshot_sha(tmp_path / "models--org--name" / "snapshots" / "main" / "t.json") is None
    assert snapshot_sha(tmp_path / "snapshots" / SHA / "tokenizer.json") is None  # not a repo
    assert snapshot_sha(tmp_path / "my-model" / "tokenizer.json") is None
    assert snapshot_sha(None) is None


def test_pipeline_tag_for_causal_lms_only() -> None:
    assert pipeline_tag({"architectures": ["LlamaForCausalLM"]}) == "text-generation"
    assert pipeline_tag({"architectures": ["GPT2LMHeadModel"]}) == "text-generation"
    assert pipeline_tag({"architectures": ["BertForMaskedLM"]}) is None
    assert pipeline_tag({}) is None and pipeline_tag(None) is None
