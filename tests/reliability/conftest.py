"""One shard process of the tiny Llama for the reliability tests that do not hurt it; each module
starts its own router in front of it (one router at a time)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.shard_process import ShardProcesses, start_shards


@pytest.fixture(scope="package")
def llama(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="package")
def shard(llama: Path) -> Iterator[ShardProcesses]:
    with start_shards(llama) as processes:
        yield processes
