"""The transformers continuous-batching row: it must count the tokens generate_batch really
returns, and report an error (not 0 tokens, ok) when transformers hands back failed requests.

On an H100 with transformers 5.17 the row once came back ok with 0 tokens: the function ran under
inference mode, so the paged cache transformers allocated could not be written by its generation
thread, every request failed, and generate_batch returned them without raising.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pytgi_bench.compare.hf_baselines import RequestsFailed, _check_outputs, hf_continuous
from pytgi_bench.compare.model_builder import LlamaShape, build_random_llama

TINY = LlamaShape("unit-tiny", 32, 64, 1, 2, 1, vocab_size=1100, max_position_embeddings=128)


def _output(tokens: list[int], *, failed: bool = False):  # type: ignore[no-untyped-def]
    """A request result as the installed transformers builds it."""
    from transformers.generation.continuous_batching.requests import (
        GenerationOutput,
        RequestStatus,
    )

    status = RequestStatus.FAILED if failed else RequestStatus.FINISHED
    error = "Inplace update to inference tensor" if failed else None
    return GenerationOutput("req", generated_tokens=tokens, error=error, status=status)


def test_finished_requests_with_tokens_pass() -> None:
    _check_outputs([_output([5, 6]), _output([7])], 2, None)


@pytest.mark.parametrize(
    ("outputs", "expected"),
    [
        ([_output([], failed=True), _output([], failed=True)], "2 failed, 2 without tokens"),
        ([_output([5]), _output([])], "0 failed, 1 without tokens"),
        ([_output([5])], "1/2 requests returned"),
    ],
)
def test_failed_empty_or_missing_requests_raise(outputs: list, expected: str) -> None:
    with pytest.raises(RequestsFailed, match=expected):
        _check_outputs(outputs, 2, "logged reason")


def test_the_request_error_is_the_reason_given() -> None:
    with pytest.raises(RequestsFailed, match="Inplace update to inference tensor"):
        _check_outputs([_output([], failed=True)], 1, "a later log line")


def test_patched_cpu_row_generates_every_token(tmp_path: Path) -> None:
    """Sized for the tiny model (16 blocks, 64 batch tokens): left to its defaults, transformers
    5.24 plans 8,192 batch tokens and 1,024 logit rows, which 64 MiB cannot hold (N/A)."""
    model = build_random_llama(tmp_path / "m", TINY, None)
    prompts = [[5, 9, 200, 7], [11, 12], [300, 301, 302, 303, 304, 305]]
    result = hf_continuous(
        model, prompts, 4, 1, torch.float32, "cpu", num_blocks=16, max_batch_tokens=64,
        cpu_memory_bytes=64 * 2**20,
    )
    assert result.status == "ok", result.error
    assert result.output_tokens == [3 * 4]
