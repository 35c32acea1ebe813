"""The tiny Llama and a shard process serving it, for the integration modules that need nothing
else: each module gets its own (module scope), so a module's router flags and the requests it
leaves behind never reach another's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.shard_process import ShardProcesses, start_shards


@pytest.fixture(scope="module")
def model(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def shards(model: Path) -> Iterator[ShardProcesses]:
    with start_shards(model) as s:
        yield s
