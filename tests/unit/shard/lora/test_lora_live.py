"""Live LoRA loading through the Engine (LoadAdapter/UnloadAdapter) and --max-loras eviction: a
live-loaded adapter answers what transformers gives on the merged weights; unloaded, it is
refused; an index reused by another adapter runs that adapter's weights; four adapters under a
cap of two device slots each keep their own answers while being evicted and copied back; a step
past the cap is refused; rows in flight finish after their adapter is unloaded."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.engine import Engine
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.service.startup import StartupRefused, load_engine
from pytgi_shard.settings import ShardSettings
from tests.hf_reference import hf_greedy
from tests.lora_adapters import merged_model, write_adapter
from tests.unit.shard.engine.test_batch import batch_of, request
from tests.unit.shard.engine.test_engine import Run, solo

PROMPT = [12, 40, 77, 9, 150, 33, 21]
NEW = 6
NAMES = ("a", "b", "c", "d")


@pytest.fixture(scope="module")
def adapters(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, Path]:
    """Four rank-4 adapters on every projection (different seeds), one rank-16."""
    root = tmp_path_factory.mktemp("lora_live")
    base = tiny_model("llama")
    out = {name: write_adapter(root / name, base, rank=4, alpha=8, seed=10 + i)
           for i, name in enumerate(NAMES)}
    out["wide"] = write_adapter(root / "wide", base, rank=16, alpha=16, seed=9)
    return out


@pytest.fixture(scope="module")
def expected(tiny_model: Callable[..., Path], adapters: dict[str, Path],
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Each adapter's greedy tokens from transformers on its merged weights."""
    root = tmp_path_factory.mktemp("merged")
    out = {name: hf_greedy(merged_model(root / name, tiny_model("llama"), adapters[name]),
                           PROMPT, NEW, ignore_eos=True)[0] for name in NAMES}
    assert len({tuple(t) for t in out.values()}) == len(NAMES)  # distinct: the test can fail
    return out


def live_engine(model: Path, max_loras: int = 2) -> Engine:
    engine = load_engine(ShardSettings(model_path=model, block_size=4, lora_runtime_updates=True,
                                       max_loras=max_loras, max_lora_rank=8))
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=128, max_batch_total_tokens=2048))
    return engine


@pytest.fixture
def engine(tiny_model: Callable[..., Path]) -> Iterator[Engine]:
    yield live_engine(tiny_model("llama"))


def load(engine: Engine, name: str, path: Path, index: int) -> None:
    engine.load_adapter(pb.LoadAdapterRequest(name=name, source=str(path), index=index))


def lora_request(rid: int, adapter: int) -> pb.Request:
    return request(rid, PROMPT, max_new=NEW, ignore_eos=True, adapter_index=adapter)


def test_load_use_unload(engine: Engine, adapters: dict[str, Path],
                         expected: dict[str, list[int]]) -> None:
    info = engine.info()
    assert (info.max_loras, info.max_lora_rank, info.lora_runtime_updates) == (2, 8, True)
    assert list(info.lora_adapters) == []
    load(engine, "a", adapters["a"], 1)
    assert list(engine.info().lora_adapters) == ["a"]
    assert solo(engine, lora_request(1, 1)).tokens[1] == expected["a"]
    engine.unload_adapter(pb.UnloadAdapterRequest(index=1))
    assert list(engine.info().lora_adapters) == []
    with pytest.raises(InvalidRequest, match="adapter_index 1 names no loaded LoRA adapter"):
        engine.prefill(pb.PrefillRequest(batch=batch_of(lora_request(2, 1))))
    with pytest.raises(InvalidRequest, match="no LoRA adapter is loaded at index 1"):
        engine.unload_adapter(pb.UnloadAdapterRequest(index=1))
    # The index again, another adapter: its own weights, nothing left of the first.
    load(engine, "b", adapters["b"], 1)
    assert solo(engine, lora_request(3, 1)).tokens[3] == expected["b"]


def test_four_adapters_under_two_slots_keep_their_answers(
    engine: Engine, adapters: dict[str, Path], expected: dict[str, list[int]]
) -> None:
    for index, name in enumerate(NAMES, 1):
        load(engine, name, adapters[name], index)
    assert engine.adapters.table.resident() == [1, 2]
    rid = 10
    for pair in [(1, 2), (3, 4), (1, 3), (2, 4), (4, 1)]:
        reqs = [lora_request(rid + i, index) for i, index in enumerate(pair)]
        run = Run(engine)
        run.finish(run.prefill(batch_of(*reqs, batch_id=rid)))
        for r, index in zip(reqs, pair, strict=True):
            assert run.tokens[r.id] == expected[NAMES[index - 1]], (pair, index)
        rid += 2
    assert engine.adapters.evictions >= 6
    # Two adapters running: a third cannot join them in one step.
    run = Run(engine)
    cached = run.prefill(batch_of(lora_request(50, 1), lora_request(51, 2), batch_id=50))
    assert cached is not None
    with pytest.raises(InvalidRequest, match="3 LoRA adapters resident at once, more than "
                                             "--max-loras 2"):
        engine.prefill(pb.PrefillRequest(batch=batch_of(lora_request(52, 3), batch_id=51),
                                         cached_batch=cached))
    run.finish(run.decode(cached))  # the running batch is intact
    assert run.tokens[50] == expected["a"] and run.tokens[51] == expected["b"]


def test_rows_in_flight_finish_after_their_adapter_is_unloaded(
    engine: Engine, adapters: dict[str, Path], expected: dict[str, list[int]]
) -> None:
    load(engine, "a", adapters["a"], 1)
    run = Run(engine)
    cached = run.prefill(batch_of(lora_request(1, 1)))
    assert cached is not None
    engine.unload_adapter(pb.UnloadAdapterRequest(index=1))
    with pytest.raises(InvalidRequest, match="names no loaded LoRA adapter"):
        engine.prefill(pb.PrefillRequest(batch=batch_of(lora_request(2, 1), batch_id=2)))
    with pytest.raises(InvalidRequest, match="index 1 is taken"):
        load(engine, "b", adapters["b"], 1)  # still draining: its row is live
    run.finish(run.decode(cached))
    assert run.tokens[1] == expected["a"]
    load(engine, "b", adapters["b"], 1)  # the row left: the index is free again
    assert solo(engine, lora_request(3, 1)).tokens[3] == expected["b"]


def test_bad_loads_are_refused_naming_the_reason(
    engine: Engine, adapters: dict[str, Path], tmp_path: Path
) -> None:
    load(engine, "a", adapters["a"], 1)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text((adapters["b"] / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"not safetensors")
    cases = [
        ("corrupt", corrupt, 2, "'corrupt': cannot read"),
        ("a", adapters["b"], 2, "'a' is already loaded"),
        ("b", adapters["b"], 1, "index 1 is taken"),
        ("wide", adapters["wide"], 2, "rank r=16 exceeds --max-lora-rank 8"),
        ("gone", tmp_path / "nowhere", 2, "does not exist"),
        ("empty", tmp_path, 2, "has no adapter_config.json"),
        ("bad name!", adapters["b"], 2, "use letters, digits"),
    ]
    for name, path, index, message in cases:
        with pytest.raises(InvalidRequest, match=message):
            load(engine, name, path, index)
    assert list(engine.info().lora_adapters) == ["a"]


def test_an_adapter_of_another_model_is_refused(
    engine: Engine, tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    other = write_adapter(tmp_path / "other", tiny_model("mistral"), rank=4, alpha=8)
    with pytest.raises(InvalidRequest, match="the base model's is"):
        load(engine, "other", other, 1)


def test_without_runtime_updates_loads_are_refused(
    tiny_model: Callable[..., Path], adapters: dict[str, Path]
) -> None:
    engine = load_engine(ShardSettings(model_path=tiny_model("llama"), block_size=4,
                                       lora_adapters=f"a={adapters['a']}"))
    with pytest.raises(InvalidRequest, match="runtime updates are off"):
        load(engine, "b", adapters["b"], 2)
    info = engine.info()
    assert (list(info.lora_adapters), info.max_loras, info.lora_runtime_updates) == (
        ["a"], 1, False)
    assert torch.count_nonzero(engine.adapters.sites.sites[0].lora.a[1]) > 0  # type: ignore[union-attr]


def test_slot_flags_out_of_range_are_refused_at_start_up(
    tiny_model: Callable[..., Path], adapters: dict[str, Path]
) -> None:
    model = tiny_model("llama")
    for settings, message in [
        (dict(lora_runtime_updates=True, max_lora_rank=65), "--max-lora-rank 65 is not in 1..64"),
        (dict(lora_runtime_updates=True, max_loras=-1), "--max-loras -1 must be >= 1"),
        (dict(lora_adapters=f"wide={adapters['wide']}", max_lora_rank=8),
         "'wide': rank r=16 exceeds --max-lora-rank 8"),
    ]:
        with pytest.raises(StartupRefused, match=message):
            load_engine(ShardSettings(model_path=model, **settings))  # type: ignore[arg-type]


def test_start_up_adapters_past_the_cap_wait_in_host_memory(
    tiny_model: Callable[..., Path], adapters: dict[str, Path], expected: dict[str, list[int]]
) -> None:
    """--lora-adapters with four adapters and --max-loras 2 (no runtime updates): two slots,
    each adapter still answers its own."""
    spec = ",".join(f"{name}={adapters[name]}" for name in NAMES)
    engine = load_engine(ShardSettings(model_path=tiny_model("llama"), block_size=4,
                                       lora_adapters=spec, max_loras=2))
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=128, max_batch_total_tokens=2048))
    assert (engine.info().max_loras, engine.adapters.sites.sites[0].lora.slots) == (2, 3)  # type: ignore[union-attr]
    for index, name in enumerate(NAMES, 1):
        assert solo(engine, lora_request(index, index)).tokens[index] == expected[name]
    assert engine.adapters.evictions >= 2
