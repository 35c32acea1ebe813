"""The llama.cpp comparison's offline parts: its table and medians, and the one-line refusals
of the build when a tool or a product is missing (the build itself is not run in tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytgi_bench.compare import llama_cpp_build
from pytgi_bench.compare.llama_cpp import _medians, parse_args, table
from pytgi_bench.compare.llama_cpp_build import BuildError, server_binary


def _round(pytgi: float, llama: float) -> dict[str, dict[str, float]]:
    row = {"concurrent_output_tok_s": 0.0, "single_decode_tok_s": 0.0, "single_ttft_p50_ms": 0.0}
    return {"pytgi": {k: pytgi for k in row}, "llama.cpp": {k: llama for k in row}}


def test_medians_and_ratios() -> None:
    medians = _medians([_round(1.0, 4.0), _round(3.0, 2.0), _round(2.0, 3.0)])
    assert medians["pytgi"]["single_decode_tok_s"] == {"median": 2.0, "min": 1.0, "max": 3.0}
    text = table(medians)
    # Throughputs: pytgi / llama.cpp; TTFT: llama.cpp / pytgi (above 1 when pytgi is faster).
    assert "| 64 concurrent, output tok/s | 2.0 (1.0-3.0) | 3.0 (2.0-4.0) | 0.67x |" in text
    assert "| single stream, TTFT ms | 2.0 (1.0-3.0) | 3.0 (2.0-4.0) | 1.50x |" in text


def test_defaults_are_the_issue_workload() -> None:
    args = parse_args([])
    assert (args.requests, args.new_tokens, args.threads) == (64, 64, 2)
    assert "-np 64" in args.llama_args and "-t 2" in args.llama_args


def test_missing_compiler_is_one_clear_line(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama_cpp_build.shutil, "which",
                        lambda tool: None if tool == "c++" else "/usr/bin/" + tool)
    with pytest.raises(BuildError, match=r"^cannot build llama.cpp here: c\+\+ not on PATH$"):
        server_binary(tmp_path)


def test_a_cached_binary_is_reused(tmp_path: Path) -> None:
    binary = tmp_path / "cmake-build" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("")
    assert server_binary(tmp_path) == binary
