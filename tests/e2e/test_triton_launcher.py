"""`pytgi-launcher --attention triton` end to end: the Triton kernels serve real HTTP requests.

Without a GPU the shard runs the kernels under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1, which the launcher's children inherit), so the budgets are kept tiny; the
greedy tokens must equal transformers' — what the reference backend gives (test_launcher.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from text_generation import Client

from tests.e2e.test_launcher import transformers_greedy
from tests.launcher_process import Launcher

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def triton_launcher(tiny_model: Callable[..., Path]) -> Iterator[Launcher]:
    launcher = Launcher(
        "--model-id", str(tiny_model("llama")), "--num-shard", "1", "--attention", "triton",
        "--max-input-tokens", "24", "--max-total-tokens", "48",
        "--max-batch-prefill-tokens", "48", "--max-batch-total-tokens", "512",
    )  # fmt: skip
    try:
        yield launcher.wait_ready()
    finally:
        launcher.close()


def test_triton_attention_serves_transformers_greedy_tokens(
    triton_launcher: Launcher, tiny_model: Callable[..., Path]
) -> None:
    assert "triton attention" in triton_launcher.output  # the shard's start-up line
    prompt = "The quick brown fox"
    response = Client(triton_launcher.url, timeout=120).generate(
        prompt, max_new_tokens=10, do_sample=False
    )
    ids, text = transformers_greedy(tiny_model("llama"), prompt, 10)
    assert [t.id for t in response.details.tokens] == ids
    assert response.generated_text == text
