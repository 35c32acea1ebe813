"""Shared fixtures: tiny models in real Hugging Face layout, built once per test session."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; the variable is read
# when a kernel module is imported, so it must be set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.tiny_models import build_model

# The test files whose outcome depends on the transformers, huggingface-hub and tokenizers
# releases: model families and encoder-decoders against transformers' own forward, config layouts,
# loading, hub resolution and its client, tokenizer, detokenizer and chat-template paths. The
# whole suite runs on the newest releases; `make test` runs these again on the lowest pyproject
# allows (`-m transformers_stack`). Named by file, not path, so that moving a file keeps it here;
# tests/unit/test_dependency_bounds.py fails on a name no file has any more.
TRANSFORMERS_STACK_FILES = frozenset({
    "test_config_layout.py", "test_models.py", "test_model_families.py", "test_models_gpt.py",
    "test_t5.py", "test_moe.py", "test_alibi_attention.py", "test_learned_positions.py",
    "test_quantization_detection.py", "test_loading_safety.py", "test_model_resolution.py",
    "test_detokenizer.py", "test_chat_template.py", "test_validation.py", "test_token_bound.py",
    "test_model_card.py", "test_demo_model.py", "test_hf_baselines.py", "test_clients.py",
})


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test` runs two workers) each worker's torch takes its share of
    the cores: two workers with a thread per core each would contend for every core."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the tests of TRANSFORMERS_STACK_FILES `transformers_stack`."""
    for item in items:
        if item.path.name in TRANSFORMERS_STACK_FILES:
            item.add_marker(pytest.mark.transformers_stack)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny_model("llama" | "mistral" | "qwen2" | "gpt2", sharded=False) -> model directory."""
    root = tmp_path_factory.mktemp("models")
    built: dict[tuple[str, bool], Path] = {}

    def get(family: str = "llama", sharded: bool = False) -> Path:
        key = (family, sharded)
        if key not in built:
            name = f"{family}-sharded" if sharded else family
            built[key] = build_model(root / name, family, shard_size="200KB" if sharded else None)
        return built[key]

    return get
