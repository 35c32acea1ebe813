"""Drives a shard Engine as the issue-13 router does, for the chunking, prefix-cache, grant and
resume tests: KV blocks allocated as sequences grow (granted before each step), prompts sent
in chunks (partial prefills leave no shard state), newcomers mixed into the running batch's
step, and the reference run every variant must reproduce."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.engine import Engine
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import ShardSettings
from tests.unit.shard.engine.test_engine import Run

BLOCK = 4
# engines(overlap=False, attention="reference", grammar_thread=None) -> Engine (the fixture).
Engines = Callable[..., Engine]


def build_engine(
    model: Path,
    overlap: bool = False,
    attention: str = "reference",
    grammar_thread: bool | None = None,
    block: int = BLOCK,
) -> Engine:
    settings = ShardSettings(
        model_path=model,
        block_size=block,
        overlap=overlap,
        attention=attention,
        grammar_thread=grammar_thread,
    )
    engine = load_engine(settings)
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=warmup_prefill(attention),
                                   max_batch_total_tokens=2048))
    return engine


def warmup_prefill(attention: str) -> int:
    """The Warmup's prefill: 128 tokens, but 16 (the tests' prefills are shorter) under Triton's
    interpreter on the CPU, where 128 took ~20 s per engine (and the shard enforces no limit from
    it: the KV cache is sized by max_batch_total_tokens)."""
    return 16 if attention == "triton" else 128


def prompt_of(length: int, salt: int = 0) -> list[int]:
    """A deterministic prompt of ordinary (non-special) token ids of the tiny vocabulary."""
    return [(7 * j + 13 * salt + 5) % 300 + 10 for j in range(length)]


def request(
    rid: int,
    prompt: list[int],
    max_new: int,
    blocks: list[int],
    **fields: object,
) -> pb.Request:
    stop = list(fields.pop("stop", ()))  # type: ignore[call-overload]
    return pb.Request(
        id=rid,
        input_ids=prompt,
        stopping_parameters=pb.StoppingCriteriaParameters(
            max_new_tokens=max_new, ignore_eos_token=True, stop_sequences=stop
        ),
        blocks=blocks,
        **fields,  # type: ignore[arg-type]
    )


def reference_run(engine: Engine, reqs: Iterable[pb.Request]) -> Run:
    """Each request alone, its whole sequence in one prefill, blocks for its whole life."""
    run = Run(engine)
    for r in reqs:
        full = pb.Request()
        full.CopyFrom(r)
        full.ClearField("cache_len")
        full.ClearField("chunk_len")
        tokens = len(r.input_ids) + r.stopping_parameters.max_new_tokens
        full.blocks[:] = list(range(1, 1 + math.ceil(tokens / engine.block_size)))
        run.finish(run.prefill(pb.Batch(id=900 + r.id, requests=[full], size=1)))
    return run


@dataclass
class Router:
    """KV blocks on demand and the running batch, router style."""

    engine: Engine
    # Where the router believes every running request stands: known tokens, blocks held.
    known: dict[int, int] = field(default_factory=dict)
    blocks: dict[int, list[int]] = field(default_factory=dict)
    next_block: int = 1
    cached: pb.CachedBatch | None = None
    # Grant only what the step feeds (not the look-ahead's token): a late router.
    late: bool = False

    def __post_init__(self) -> None:
        self.run = Run(self.engine)

    def allocate(self, rid: int, tokens: int) -> list[int]:
        """Grows request `rid` to hold `tokens`; returns the blocks it gained."""
        held = self.blocks.setdefault(rid, [])
        need = math.ceil(tokens / self.engine.block_size) - len(held)
        new = list(range(self.next_block, self.next_block + max(need, 0)))
        self.next_block += len(new)
        held.extend(new)
        return new

    def grants(self) -> list[pb.BlockGrant]:
        """Every running request grown to its known tokens plus one (plus none when late)."""
        out = []
        ids = list(self.cached.request_ids) if self.cached is not None else []
        for rid in ids:
            new = self.allocate(rid, self.known[rid] + (0 if self.late else 1))
            if new:
                out.append(pb.BlockGrant(request_id=rid, blocks=new))
        return out

    def chunk(self, r: pb.Request, cache_len: int, chunk_len: int) -> pb.Request:
        """`r` computing tokens [cache_len, cache_len + chunk_len) with blocks for them plus one."""
        out = pb.Request()
        out.CopyFrom(r)
        total = len(r.input_ids) + len(r.generated_ids)
        end = min(cache_len + chunk_len, total) if chunk_len else total
        self.allocate(r.id, end + 1)
        out.cache_len, out.chunk_len = cache_len, end - cache_len
        out.blocks[:] = self.blocks[r.id]
        return out

    def prefill(self, batch_id: int, reqs: list[pb.Request]) -> pb.PrefillResponse:
        """One Prefill of `reqs` (chunks), mixed into the running batch's step when there is one."""
        step = pb.PrefillRequest(batch=pb.Batch(id=batch_id, requests=reqs, size=len(reqs)))
        if self.cached is not None:
            step.grants.extend(self.grants())
            step.cached_batch.CopyFrom(self.cached)
        response = self.engine.prefill(step)
        self.absorb(response, {r.id: r for r in reqs})
        return response

    def decode(self) -> pb.DecodeResponse:
        assert self.cached is not None
        step = pb.DecodeRequest(batches=[self.cached], grants=self.grants())
        response = self.engine.decode(step)
        self.absorb(response, {})
        return response

    def finish(self) -> None:
        while self.cached is not None:
            self.decode()

    def absorb(
        self, response: pb.PrefillResponse | pb.DecodeResponse, new: dict[int, pb.Request]
    ) -> None:
        self.run.absorb(list(response.generations))
        for g in response.generations:
            if g.tokens.ids:
                r = new.get(g.request_id)
                if r is not None:
                    self.known[r.id] = len(r.input_ids) + len(r.generated_ids)
                self.known[g.request_id] += len(g.tokens.ids)
        self.cached = response.batch if response.HasField("batch") else None


def chunked(
    router: Router, rid_requests: list[pb.Request], size: int, batch_id: Callable[[], int]
) -> None:
    """Prefills each request alone in chunks of `size` tokens (the last one completes it)."""
    for r in rid_requests:
        total = len(r.input_ids) + len(r.generated_ids)
        start = r.cache_len
        while start < total:
            router.prefill(batch_id(), [router.chunk(r, start, size)])
            start += size
