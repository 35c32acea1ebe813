"""LoraUpdates against a shard group that restarted: the replay runs under the same lock as live
loads and unloads (a load waits for it, and it for a load), and an adapter the new group no
longer loads is dropped together with its per-adapter metric series, as an unload drops them."""

from __future__ import annotations

import asyncio
from typing import cast

from pytgi_router.core.infer import Infer
from pytgi_router.core.infer_settings import InferSettings
from pytgi_router.core.lora_adapters import AdapterTable
from pytgi_router.core.shard_client import AdapterRefused, ShardClient
from pytgi_router.metrics import Metrics


class Shards:
    """The LoadAdapter/UnloadAdapter calls of a shard group: what each index holds, the
    sources it refuses, and (gate) a load that waits until the test lets it finish."""

    def __init__(self, refuse: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.held: dict[int, str] = {}
        self.refuse = refuse
        self.calls: list[str] = []
        self.gate: asyncio.Event | None = None

    async def load_adapter(self, name: str, source: str, index: int,
                           timeout: float | None = None) -> int:
        self.calls.append(f"load {name}@{index}")
        if self.gate is not None:
            await self.gate.wait()
        if source in self.refuse:
            raise AdapterRefused(f"LoRA adapter {name!r}: {source} does not exist")
        if index in self.held:
            raise AdapterRefused(f"LoRA adapter {name!r}: index {index} is taken")
        self.held[index] = name
        return 8

    async def unload_adapter(self, index: int, timeout: float | None = None) -> None:
        self.calls.append(f"unload {index}")
        self.held.pop(index, None)


def infer_on(shards: Shards) -> Infer:
    infer = Infer(cast(ShardClient, shards), InferSettings(), Metrics())
    infer.adapters = AdapterTable((), 4, runtime_updates=True)
    return infer


def series(metrics: Metrics, name: str) -> set[str]:
    return {s.labels["adapter"] for m in metrics.registry.collect() for s in m.samples
            if s.name == name}


def test_a_dropped_adapter_loses_its_metric_series() -> None:
    shards = Shards(refuse={"/gone"})
    infer = infer_on(shards)
    updates = infer.lora_updates

    async def run() -> None:
        await updates.load("kept", "/kept")
        await updates.load("gone", "/ok-then")
        infer.metrics.adapter_served("kept", 3)
        infer.metrics.adapter_served("gone", 5)
        # The group restarts: it holds nothing, and gone's files are no longer there.
        infer.client = cast(ShardClient, Shards(refuse={"/ok-then"}))
        async with updates.held():
            await updates.replay([])

    asyncio.run(run())
    assert infer.adapters.names() == ["kept"]
    assert series(infer.metrics, "pytgi_lora_requests_total") == {"kept"}
    assert series(infer.metrics, "pytgi_lora_generated_tokens_total") == {"kept"}


def test_a_live_load_and_the_replay_never_overlap() -> None:
    """A load in progress (on the lost group) holds the restart back until it ends; a load
    arriving during the restart waits for it, then lands on the new group, which already holds
    the table's adapters (b's included): none is loaded twice, none dropped."""
    old = Shards()
    infer = infer_on(old)
    updates = infer.lora_updates
    new = Shards()

    async def run() -> None:
        await updates.load("a", "/a")
        old.gate = asyncio.Event()
        first = asyncio.ensure_future(updates.load("b", "/b"))
        await asyncio.sleep(0.01)

        async def restart() -> None:
            async with updates.held():
                infer.client = cast(ShardClient, new)
                await updates.replay([])

        replay = asyncio.ensure_future(restart())
        await asyncio.sleep(0.01)
        late = asyncio.ensure_future(updates.load("c", "/c"))
        await asyncio.sleep(0.01)
        assert new.calls == [] and infer.client is old  # the restart waits for b's load
        old.gate.set()
        await asyncio.gather(first, replay, late)

    asyncio.run(run())
    assert old.calls == ["load a@1", "load b@2"]
    assert new.calls == ["load a@1", "load b@2", "load c@3"]
    assert infer.adapters.names() == ["a", "b", "c"]
    assert new.held == {1: "a", 2: "b", 3: "c"}
