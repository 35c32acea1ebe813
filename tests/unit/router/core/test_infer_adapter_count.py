"""An adapter's in-flight count (AdapterTable, what an unload waits on before the shards free
the index) holds a request until it is out of the scheduler: a cancelled request that is in the
running batch stays counted until the scheduler retires it (its rows are on the shards until
then), while one cancelled in the queue leaves at once. Runs the real Infer and Scheduler
against the in-process model of the shards (model_shard.py)."""

from __future__ import annotations

import asyncio
from typing import cast

from pytgi_proto import generate_pb2
from pytgi_proto.parameters import neutral_sampling
from pytgi_router.core.capacity import derive_info, new_cache
from pytgi_router.core.infer import Infer
from pytgi_router.core.infer_settings import InferSettings
from pytgi_router.core.lora_adapters import AdapterTable
from pytgi_router.core.queue import Queue
from pytgi_router.core.request import StoppingParameters, ValidRequest
from pytgi_router.core.scheduler import Scheduler
from pytgi_router.core.shard_client import ShardClient
from pytgi_router.core.step_plan import Budgets
from pytgi_router.metrics import Metrics
from tests.unit.router.model_shard import ModelShard

SETTINGS = InferSettings(max_batch_prefill_tokens=512)
INFO = generate_pb2.InfoResponse(dtype="float32", device_type="cpu", attention_impl="reference",
                                 block_size=16, model_type="llama", world_size=1)
WARMUP = generate_pb2.WarmupResponse(max_supported_total_tokens=64 * 16, max_input_tokens=255,
                                     max_total_tokens=256, num_blocks=65, block_size=16)


def serving_infer() -> tuple[Infer, Scheduler]:
    """An Infer serving adapter "a" at index 1, its batching stepped by the test."""
    info = derive_info(SETTINGS, INFO, WARMUP, 1)
    cache = new_cache(info, True)
    shard = cast(ShardClient, ModelShard(cache))
    infer = Infer(shard, SETTINGS, Metrics())
    infer.adapters = AdapterTable(("a",), 2)
    infer._info = info
    infer._scheduler = Scheduler(shard, Queue(), cache, Budgets.of(SETTINGS, info),
                                 infer.metrics, infer._release)
    return infer, infer._scheduler


def under_a(infer: Infer) -> ValidRequest:
    ref = infer.adapters.get("a")
    assert ref is not None
    return ValidRequest(inputs="x", input_ids=[1, 2, 1, 2], truncate=4,
                        sampling=neutral_sampling(),
                        stopping=StoppingParameters(max_new_tokens=50),
                        adapter_index=ref.index, adapter_key=ref.key, adapter_name="a")


def test_a_cancelled_request_counts_until_it_leaves_the_running_batch() -> None:
    async def run() -> None:
        infer, scheduler = serving_infer()
        table = infer.adapters
        running = infer.submit(under_a(infer))
        assert await scheduler._step()  # its prefill: in the running batch now
        assert infer.adapter_activity()[1] == {1} and table.in_flight(1) == 1
        queued = infer.submit(under_a(infer))
        assert table.in_flight(1) == 2
        queued.cancel()  # in the queue: out of the scheduler at once
        assert table.in_flight(1) == 1
        running.cancel()
        assert infer.in_flight == 0  # its permit is back at once
        # ... but its rows are in the shards' batch until the next step retires it.
        assert infer.adapter_activity()[1] == {1} and table.in_flight(1) == 1
        await scheduler._step()
        assert infer.adapter_activity()[1] == set() and table.in_flight(1) == 0
        await asyncio.wait_for(table.until_idle(1), 1)

    asyncio.run(run())


def test_a_finished_request_leaves_the_count() -> None:
    async def run() -> None:
        infer, scheduler = serving_infer()
        request = under_a(infer)
        request.stopping.max_new_tokens = 2
        stream = infer.submit(request)
        while await scheduler._step():
            pass
        assert [e async for e in stream][-1].token.id >= 0  # type: ignore[attr-defined]
        assert infer.adapters.in_flight(1) == 0 and infer.in_flight == 0

    asyncio.run(run())
