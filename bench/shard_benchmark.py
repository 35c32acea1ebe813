"""`pytgi-benchmark shards`: prefill and decode latency of the shards, measured over gRPC.

The same protocol as TGI's text-generation-benchmark, to separate engine cost from router cost:
for each batch size, a batch of `sequence_length`-token prompts is prefilled once, then decoded
until every request has `decode_length` tokens (the prefill makes the first one, so there are
decode_length - 1 Decode calls), `runs` times after `warmups` untimed runs. It talks to every
rank (ServiceDiscovery on rank 0) through the router's own ShardClient, as the router would, and
clears the shard cache between runs — so point it at an idle server.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from pytgi_bench.summary import LatencyStats
from pytgi_proto import generate_pb2

if TYPE_CHECKING:
    from pytgi_router.core.shard_client import ShardClient

# Ids below this are special tokens in every tokenizer we build or load (BOS, EOS, PAD).
_FIRST_PLAIN_ID = 3


@dataclass(slots=True, frozen=True)
class ShardBenchSettings:
    master: str
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    sequence_length: int = 10
    decode_length: int = 8
    runs: int = 10
    warmups: int = 1
    seed: int = 0
    connect_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError("--batch-size values must be positive")
        if self.sequence_length < 1 or self.decode_length < 1:
            raise ValueError("--sequence-length and --decode-length must be positive")
        if self.runs < 1 or self.warmups < 0:
            raise ValueError("--runs must be >= 1 and --warmups >= 0")


@dataclass(slots=True)
class BatchSizeResult:
    batch_size: int
    # Client-side seconds per run.
    prefill_latency: list[float] = field(default_factory=list)
    decode_latency: list[float] = field(default_factory=list)
    decode_steps: list[int] = field(default_factory=list)
    # Shard-reported total_ns of each call, to split gRPC/client time from engine time.
    prefill_shard: list[float] = field(default_factory=list)
    decode_step_shard: list[float] = field(default_factory=list)
    # Of which the model forward (the rest: sampling, stopping, detokenizing, bookkeeping).
    decode_step_forward: list[float] = field(default_factory=list)

    def summary(self, sequence_length: int) -> dict[str, object]:
        token_latency = [
            t / s for t, s in zip(self.decode_latency, self.decode_steps, strict=True) if s
        ]
        prefill_tput = [self.batch_size * sequence_length / t for t in self.prefill_latency]
        decode_tput = [
            self.batch_size * s / t
            for t, s in zip(self.decode_latency, self.decode_steps, strict=True)
            if t
        ]
        return {
            "batch_size": self.batch_size,
            "prefill_latency": asdict(LatencyStats.of(self.prefill_latency)),
            "prefill_throughput": _value_stats(prefill_tput),
            "decode_token_latency": asdict(LatencyStats.of(token_latency)),
            "decode_total_latency": asdict(LatencyStats.of(self.decode_latency)),
            "decode_throughput": _value_stats(decode_tput),
            "decode_steps": self.decode_steps[0] if self.decode_steps else 0,
            "prefill_shard_ms": _mean_ms(self.prefill_shard),
            "decode_step_shard_ms": _mean_ms(self.decode_step_shard),
            "decode_step_forward_ms": _mean_ms(self.decode_step_forward),
        }


def _mean_ms(seconds: list[float]) -> float:
    return 1000.0 * sum(seconds) / len(seconds) if seconds else 0.0


def _value_stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"avg": 0.0, "min": 0.0, "max": 0.0}
    return {"avg": sum(values) / len(values), "min": min(values), "max": max(values)}


class ShardBenchmark:
    def __init__(self, client: ShardClient, settings: ShardBenchSettings) -> None:
        self._client = client
        self._settings = settings
        self._rng = random.Random(settings.seed)
        self._next_id = 0
        self.block_size = 16
        self.num_blocks = 0
        self.vocab_size = 0
        self.info: generate_pb2.InfoResponse | None = None

    async def prepare(self) -> None:
        """Info and Warmup sized for the largest batch, as the router would do at start-up."""
        s = self._settings
        self.info = await self._client.info()
        self.vocab_size = int(self.info.vocab_size) or 32000
        max_batch = max(s.batch_sizes)
        warm = await self._client.warmup(
            generate_pb2.WarmupRequest(
                max_prefill_tokens=max_batch * s.sequence_length,
                max_input_tokens=s.sequence_length,
                max_total_tokens=s.sequence_length + s.decode_length,
                max_batch_size=max_batch,
            )
        )
        self.block_size = int(warm.block_size or self.info.block_size or 16)
        self.num_blocks = int(warm.num_blocks)
        if self.num_blocks and 1 + max_batch * self._blocks_per_request() > self.num_blocks:
            raise ValueError(
                f"the shard's KV cache ({self.num_blocks} blocks of {self.block_size}) cannot "
                f"hold batch size {max_batch} x {s.sequence_length + s.decode_length} tokens"
            )

    def _blocks_per_request(self) -> int:
        tokens = self._settings.sequence_length + self._settings.decode_length
        return -(-tokens // self.block_size)

    def _batch(self, size: int) -> generate_pb2.Batch:
        s = self._settings
        per = self._blocks_per_request()
        requests = []
        for i in range(size):
            self._next_id += 1
            ids = [
                self._rng.randrange(_FIRST_PLAIN_ID, self.vocab_size)
                for _ in range(s.sequence_length)
            ]
            # Block 0 is the shard's reserved block; the router allocates from 1.
            blocks = list(range(1 + i * per, 1 + (i + 1) * per))
            requests.append(
                generate_pb2.Request(
                    id=self._next_id,
                    inputs=f"<benchmark prompt of {s.sequence_length} tokens>",
                    input_ids=ids,
                    blocks=blocks,
                    parameters=generate_pb2.NextTokenChooserParameters(
                        temperature=1.0,
                        top_p=1.0,
                        typical_p=1.0,
                        repetition_penalty=1.0,
                    ),
                    stopping_parameters=generate_pb2.StoppingCriteriaParameters(
                        max_new_tokens=s.decode_length,
                        ignore_eos_token=True,
                    ),
                    add_special_tokens=False,
                )
            )
        self._next_id += 1
        return generate_pb2.Batch(
            id=self._next_id,
            requests=requests,
            size=size,
            max_tokens=size * per * self.block_size,
            max_blocks=size * per,
        )

    async def run_once(self, size: int, result: BatchSizeResult | None) -> None:
        batch = self._batch(size)
        start = time.perf_counter()
        prefill = await self._client.prefill(batch, None)
        prefill_s = time.perf_counter() - start
        cached = prefill.batch if prefill.HasField("batch") else None
        steps = 0
        shard_ns = forward_ns = 0
        start = time.perf_counter()
        while cached is not None:
            decode = await self._client.decode([cached])
            cached = decode.batch if decode.HasField("batch") else None
            shard_ns += decode.total_ns
            forward_ns += decode.forward_ns
            steps += 1
        decode_s = time.perf_counter() - start
        await self._client.clear_cache()
        if result is not None:
            result.prefill_latency.append(prefill_s)
            result.prefill_shard.append(prefill.total_ns / 1e9)
            result.decode_latency.append(decode_s)
            result.decode_steps.append(steps)
            if steps:
                result.decode_step_shard.append(shard_ns / 1e9 / steps)
                result.decode_step_forward.append(forward_ns / 1e9 / steps)

    async def run_batch_size(self, size: int) -> BatchSizeResult:
        result = BatchSizeResult(size)
        await self._client.clear_cache()
        for _ in range(self._settings.warmups):
            await self.run_once(size, None)
        for _ in range(self._settings.runs):
            await self.run_once(size, result)
        return result
