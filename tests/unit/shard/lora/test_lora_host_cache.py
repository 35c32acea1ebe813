"""--max-cpu-loras (vLLM's flag): at most that many loaded adapters keep their fused weights in
host memory, those on the device included; past it the least recently used one off the device
and without live rows is dropped and re-read from its directory when a step needs it. Each
adapter still answers what transformers gives on its merged weights; a re-read that fails
refuses the step and leaves the device as it was; a cap below --max-loras is refused at
start-up."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.engine import Engine
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.service.startup import StartupRefused, load_engine
from pytgi_shard.settings import ShardSettings
from tests.hf_reference import hf_greedy
from tests.lora_adapters import merged_model, write_adapter
from tests.unit.shard.engine.test_batch import batch_of, request
from tests.unit.shard.engine.test_engine import solo

PROMPT = [12, 40, 77, 9, 150, 33, 21]
NEW = 6
NAMES = ("a", "b", "c", "d")


@pytest.fixture(scope="module")
def adapters(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_host")
    base = tiny_model("llama")
    return {name: write_adapter(root / name, base, rank=4, alpha=8, seed=30 + i)
            for i, name in enumerate(NAMES)}


@pytest.fixture(scope="module")
def expected(tiny_model: Callable[..., Path], adapters: dict[str, Path],
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    root = tmp_path_factory.mktemp("merged_host")
    out = {name: hf_greedy(merged_model(root / name, tiny_model("llama"), adapters[name]),
                           PROMPT, NEW, ignore_eos=True)[0] for name in NAMES}
    assert len({tuple(t) for t in out.values()}) == len(NAMES)  # distinct: the test can fail
    return out


def engine_with(model: Path, **settings: object) -> Engine:
    engine = load_engine(ShardSettings(model_path=model, block_size=4, **settings))  # type: ignore[arg-type]
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=128, max_batch_total_tokens=2048))
    return engine


def ask(engine: Engine, rid: int, index: int) -> list[int]:
    req = request(rid, PROMPT, max_new=NEW, ignore_eos=True, adapter_index=index)
    return solo(engine, req).tokens[rid]


def test_live_loads_past_the_host_cap_are_dropped_and_read_again(
    tiny_model: Callable[..., Path], adapters: dict[str, Path], expected: dict[str, list[int]]
) -> None:
    engine = engine_with(tiny_model("llama"), lora_runtime_updates=True, max_loras=1,
                         max_cpu_loras=2, max_lora_rank=8)
    for index, name in enumerate(NAMES, 1):
        engine.load_adapter(pb.LoadAdapterRequest(name=name, source=str(adapters[name]),
                                                  index=index))
        assert len(engine.adapters.in_host_memory()) <= 2
    assert engine.adapters.in_host_memory() == [1, 4]  # 1 is on the device, 4 the newest
    for rid, index in enumerate([2, 3, 1, 4, 2, 2, 3], 1):
        assert ask(engine, rid, index) == expected[NAMES[index - 1]], index
        held = engine.adapters.in_host_memory()
        assert len(held) <= 2 and index in held
        assert engine.adapters.table.resident() == [index]
    # 2 and 3 were dropped before their first use; 1, 4 and 3 again after others ran.
    assert engine.adapters.rereads >= 5
    assert [name for name in engine.info().lora_adapters] == list(NAMES)  # all still loaded


def test_a_failed_read_refuses_the_step_and_keeps_the_device(
    tiny_model: Callable[..., Path], adapters: dict[str, Path], expected: dict[str, list[int]],
    tmp_path: Path,
) -> None:
    moved = {name: shutil.copytree(adapters[name], tmp_path / name) for name in NAMES[:3]}
    spec = ",".join(f"{name}={path}" for name, path in moved.items())
    engine = engine_with(tiny_model("llama"), lora_adapters=spec, max_loras=1, max_cpu_loras=1)
    assert engine.adapters.in_host_memory() == [1]  # only the resident one at start-up
    shutil.rmtree(moved["b"])
    with pytest.raises(InvalidRequest, match="'b' was dropped from host memory "
                                             r"\(--max-cpu-loras 1\) and cannot be read again"):
        engine.prefill(pb.PrefillRequest(batch=batch_of(
            request(1, PROMPT, max_new=NEW, ignore_eos=True, adapter_index=2))))
    assert engine.adapters.table.resident() == [1]
    assert ask(engine, 2, 1) == expected["a"]  # slot 1 still holds a's weights
    assert ask(engine, 3, 3) == expected["c"]


def test_without_the_flag_every_adapter_stays_in_host_memory(
    tiny_model: Callable[..., Path], adapters: dict[str, Path]
) -> None:
    spec = ",".join(f"{name}={adapters[name]}" for name in NAMES)
    engine = engine_with(tiny_model("llama"), lora_adapters=spec, max_loras=1)
    assert engine.adapters.in_host_memory() == [1, 2, 3, 4]
    ask(engine, 1, 3)
    assert engine.adapters.in_host_memory() == [1, 2, 4, 3] and engine.adapters.rereads == 0


def test_a_host_cap_below_the_device_cap_is_refused_at_start_up(
    tiny_model: Callable[..., Path], adapters: dict[str, Path]
) -> None:
    spec = ",".join(f"{name}={adapters[name]}" for name in NAMES[:2])
    with pytest.raises(StartupRefused, match="--max-cpu-loras 1 must be >= --max-loras 2"):
        load_engine(ShardSettings(model_path=tiny_model("llama"), lora_adapters=spec,
                                  max_loras=2, max_cpu_loras=1))
