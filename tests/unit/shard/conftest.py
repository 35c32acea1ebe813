"""Shared fixtures of the shard's unit tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pytgi_shard.engine.engine import Engine
from tests.unit.shard.router_steps import Engines, build_engine


@pytest.fixture(scope="module")
def engines(tiny_model: Callable[..., Path]) -> Iterator[Engines]:
    """engines(overlap=False, attention="reference", grammar_thread=None): an engine on the tiny Llama with small
    blocks, built once per module and variant, handed out with no cached batch and no CUDA
    graphs (a test may have installed some). test_engine.py has its own, per model family."""
    built: dict[tuple[bool, str, bool | None], Engine] = {}

    def get(
        overlap: bool = False, attention: str = "reference", grammar_thread: bool | None = None
    ) -> Engine:
        key = (overlap, attention, grammar_thread)
        if key not in built:
            built[key] = build_engine(tiny_model("llama"), overlap, attention, grammar_thread)
        built[key].clear(None)
        built[key].runner.decode_graphs = None
        return built[key]

    yield get
