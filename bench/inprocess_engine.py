"""pytgi without HTTP, gRPC or a second process: the router's real Infer (queue, block allocator,
batching task with its budgets) driving the shard's real Engine through a direct-call client.

This is row (a) of bench/compare.py. Compared with row (b), end to end over HTTP, the difference
is exactly what the process split costs: HTTP parsing and SSE writing, validation/tokenization,
protobuf serialization and gRPC transport between router and shard.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from pytgi_bench.system_result import SystemResult
from pytgi_proto import generate_pb2

if TYPE_CHECKING:
    from pytgi_router.client import ShardClient

Prompts = list[list[int]]


class InProcessShardClient:
    """The router's ShardClient interface over one in-process Engine (one rank, no transport).

    Engine calls block the event loop while they compute, exactly like one gRPC shard that
    serves a call at a time; the router's own code runs unchanged between them.
    """

    def __init__(self, engine) -> None:  # type: ignore[no-untyped-def]
        self._engine = engine
        self.urls = ["in-process"]

    @property
    def world_size(self) -> int:
        return 1

    async def info(self) -> generate_pb2.InfoResponse:
        return self._engine.info()  # type: ignore[no-any-return]

    async def health(self) -> None:
        self._engine.health()

    async def service_discovery(self) -> list[str]:
        return list(self.urls)

    async def clear_cache(self, batch_id: int | None = None) -> None:
        self._engine.clear(batch_id)

    async def warmup(self, req: generate_pb2.WarmupRequest) -> generate_pb2.WarmupResponse:
        return self._engine.warmup(req)  # type: ignore[no-any-return]

    async def prefill(
        self, batch: generate_pb2.Batch, cached: generate_pb2.CachedBatch | None
    ) -> generate_pb2.PrefillResponse:
        request = generate_pb2.PrefillRequest(batch=batch)
        if cached is not None:
            request.cached_batch.CopyFrom(cached)
        return self._engine.prefill(request)  # type: ignore[no-any-return]

    async def decode(self, batches: list[generate_pb2.CachedBatch]) -> generate_pb2.DecodeResponse:
        return self._engine.decode(generate_pb2.DecodeRequest(batches=batches))  # type: ignore[no-any-return]

    async def filter_batch(
        self, batch_id: int, request_ids: list[int]
    ) -> generate_pb2.CachedBatch | None:
        return self._engine.filter(batch_id, request_ids)  # type: ignore[no-any-return]

    async def close(self) -> None:
        return None


def load_engine(model_dir: Path, dtype: torch.dtype, device: str):  # type: ignore[no-untyped-def]
    """The shard's Engine for `model_dir` on one rank, as `pytgi-shard serve` builds it."""
    from pytgi_shard.detokenizer import Detokenizer
    from pytgi_shard.distributed import single_process
    from pytgi_shard.engine import Engine
    from pytgi_shard.models import get_model
    from pytgi_shard.settings import ShardSettings

    settings = ShardSettings(model_path=model_dir)
    dist = single_process(torch.device(device))
    model = get_model(model_dir, dtype=dtype, dist=dist, attention=settings.attention)
    return Engine(model, Detokenizer.from_model_dir(model_dir), dist, settings)


async def _generate_all(infer, prompts: Prompts, new_tokens: int) -> int:  # type: ignore[no-untyped-def]
    """Submits every prompt at once (64 concurrent clients) and drains every stream."""
    from pytgi_router.events import End
    from pytgi_router.request import SamplingParameters, StoppingParameters, ValidRequest

    async def one(ids: list[int]) -> int:
        request = ValidRequest(
            inputs="",
            input_ids=ids,
            truncate=len(ids),
            sampling=SamplingParameters(),
            stopping=StoppingParameters(max_new_tokens=new_tokens),
        )
        async for event in infer.submit(request):
            if isinstance(event, End):
                return int(event.generated_tokens)
        raise RuntimeError("stream ended without its End event")

    return sum(await asyncio.gather(*(one(ids) for ids in prompts)))


async def _run(
    model_dir: Path,
    prompts: Prompts,
    new_tokens: int,
    repeats: int,
    dtype: torch.dtype,
    device: str,
    result: SystemResult,
) -> SystemResult:
    from pytgi_router.infer import Infer, InferSettings
    from pytgi_router.metrics import Metrics

    start = time.perf_counter()
    engine = load_engine(model_dir, dtype, device)
    settings = InferSettings(max_concurrent_requests=max(128, len(prompts)))
    client = cast("ShardClient", InProcessShardClient(engine))
    infer = Infer(client, settings, Metrics())
    info = await infer.start()
    result.startup_s = time.perf_counter() - start
    result.extra["max_batch_total_tokens"] = info.max_batch_total_tokens
    result.extra["max_batch_prefill_tokens"] = info.max_batch_prefill_tokens
    try:
        await _generate_all(infer, prompts[: min(4, len(prompts))], min(new_tokens, 8))
        for _ in range(repeats):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            begin = time.perf_counter()
            tokens = await _generate_all(infer, prompts, new_tokens)
            result.wall_s.append(time.perf_counter() - begin)
            result.output_tokens.append(tokens)
    finally:
        await infer.stop()
    return result


def pytgi_inprocess(
    model_dir: Path,
    prompts: Prompts,
    new_tokens: int,
    repeats: int,
    dtype: torch.dtype,
    device: str,
) -> SystemResult:
    result = SystemResult(
        "pytgi-inprocess", "pytgi router Infer + shard Engine in one process (no HTTP, no gRPC)"
    )
    return asyncio.run(_run(model_dir, prompts, new_tokens, repeats, dtype, device, result))
