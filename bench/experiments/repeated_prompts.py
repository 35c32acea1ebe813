"""Repeated prompts and the KV blocks they hold, in process: the router's own batching task
(Scheduler, step planner, PrefixCache) against a model of the shards (greedy, so a repeated
prompt generates the same tokens: tests/unit/router/model_shard.py). No model, no GPU: what it
measures is the router's block bookkeeping, which is all that decides blocks and preemptions.

    python -m pytgi_bench.experiments.repeated_prompts --streams 256 --rounds 4   # from the repository root

Each of --streams clients sends its prompt (--distinct prompts in all, of --prompt-len tokens),
reads the --new-tokens it generates, and sends the same prompt again, --rounds times in all,
into a pool of --blocks KV blocks of --block-size tokens (default: 1.25x what every stream's
request holds at its end, so the streams fit when nothing is held twice). Prints, with prefix
caching off and on, the KV blocks held (the most in one step, and the mean over the steps),
preemptions, steps, the prompt tokens served from the cache, and whether every output equals
an uncached run's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

from pytgi_proto.parameters import neutral_sampling
from pytgi_router.core.batch_wire import request_pb
from pytgi_router.core.errors import InferError
from pytgi_router.core.prefix_cache import PrefixCache
from pytgi_router.core.queue import Queue
from pytgi_router.core.request import Entry, StoppingParameters, ValidRequest
from pytgi_router.core.request_stream import End, Event, RequestStream, Token
from pytgi_router.core.scheduler import Scheduler
from pytgi_router.core.shard_client import ShardClient
from pytgi_router.core.step_plan import Budgets
from pytgi_router.metrics import Metrics
from tests.unit.router.model_shard import ModelShard, reference

VOCAB = 32000


@dataclass(slots=True)
class Workload:
    streams: int
    rounds: int
    distinct: int
    prompt_len: int
    new_tokens: int
    block_size: int
    blocks: int
    prefill_tokens: int


@dataclass(slots=True)
class Result:
    prefix_caching: bool
    peak_blocks: int
    mean_blocks: float
    preemptions: int
    steps: int
    cached_prompt_tokens: int
    requests: int
    outputs_equal: bool


def prompt_of(index: int, length: int) -> list[int]:
    """A deterministic prompt, distinct per index."""
    return [(7919 * index + 104729 * j + 13) % (VOCAB - 3) + 3 for j in range(length)]


class Clients:
    """The streams: each resubmits its prompt as soon as its previous request ended."""

    def __init__(
        self, workload: Workload, scheduler: Scheduler, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.workload = workload
        self.scheduler = scheduler
        self.loop = loop
        self.live: dict[int, tuple[int, Entry]] = {}  # stream -> (round, its request)
        self.next_id = 0
        self.requests = 0
        self.outputs_equal = True

    def submit(self, stream: int, round_index: int) -> None:
        w = self.workload
        prompt = prompt_of(stream % w.distinct, w.prompt_len)
        request = ValidRequest(
            inputs="x", input_ids=prompt, truncate=len(prompt), sampling=neutral_sampling(),
            stopping=StoppingParameters(max_new_tokens=w.new_tokens),
        )
        entry = Entry(self.next_id, request, RequestStream(), request_pb(self.next_id, request))
        self.next_id += 1
        self.live[stream] = (round_index, entry)
        self.scheduler.queue.append(entry)

    def collect(self) -> None:
        """Reads the ended streams and sends their next round."""
        for stream, (round_index, entry) in list(self.live.items()):
            if not entry.stream.closed:
                continue
            events = self.loop.run_until_complete(_read(entry.stream))
            tokens = [e.token.id for e in events if isinstance(e, Token)]
            ended = bool(events) and isinstance(events[-1], End)
            expected = reference(entry.request.input_ids, self.workload.new_tokens, VOCAB)
            self.outputs_equal &= ended and tokens == expected
            self.requests += 1
            del self.live[stream]
            if round_index + 1 < self.workload.rounds:
                self.submit(stream, round_index + 1)


async def _read(stream: RequestStream) -> list[Event]:
    """A closed stream's events (a failed one's up to its error)."""
    events: list[Event] = []
    try:
        async for event in stream:
            events.append(event)
    except InferError:
        pass
    return events


def run(workload: Workload, prefix_caching: bool) -> Result:
    """The whole workload through the batching task, one step at a time."""
    cache = PrefixCache(workload.blocks + 1, workload.block_size, prefix_caching=prefix_caching)
    shard = ModelShard(cache, checked=False, vocab=VOCAB)
    metrics = Metrics()
    budgets = Budgets(max_batch_prefill_tokens=workload.prefill_tokens,
                      max_batch_total_tokens=cache.total * workload.block_size)
    scheduler = Scheduler(cast(ShardClient, shard), Queue(), cache, budgets, metrics,
                          lambda _: None)
    loop = asyncio.new_event_loop()
    clients = Clients(workload, scheduler, loop)
    for stream in range(workload.streams):
        clients.submit(stream, 0)
    held: list[int] = []
    try:
        while clients.live:
            if not loop.run_until_complete(scheduler._step()):
                raise RuntimeError("the batching task stopped with requests left")
            held.append(cache.used_count)
            clients.collect()
    finally:
        loop.close()
    return Result(
        prefix_caching=prefix_caching,
        peak_blocks=max(held),
        mean_blocks=round(sum(held) / len(held), 1),
        preemptions=int(metrics.registry.get_sample_value("pytgi_preemptions_total") or 0),
        steps=len(held),
        cached_prompt_tokens=scheduler._cached_tokens,
        requests=clients.requests,
        outputs_equal=clients.outputs_equal,
    )


def parse(argv: list[str]) -> tuple[Workload, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m pytgi_bench.experiments.repeated_prompts",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--distinct", type=int, default=None,
                   help="distinct prompts (default: one per stream)")
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--new-tokens", type=int, default=100)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--blocks", type=int, default=None,
                   help="KV blocks (default: 1.25x the streams' requests at their end)")
    p.add_argument("--prefill-tokens", type=int, default=4096)
    p.add_argument("--out", type=Path, default=None, help="save the results as JSON")
    args = p.parse_args(argv)
    per_request = -(-(args.prompt_len + args.new_tokens) // args.block_size)
    workload = Workload(
        streams=args.streams, rounds=args.rounds, distinct=args.distinct or args.streams,
        prompt_len=args.prompt_len, new_tokens=args.new_tokens, block_size=args.block_size,
        blocks=args.blocks or int(args.streams * per_request * 1.25),
        prefill_tokens=args.prefill_tokens,
    )
    return workload, args


def main(argv: list[str] | None = None) -> None:
    workload, args = parse(sys.argv[1:] if argv is None else argv)
    results = [run(workload, caching) for caching in (False, True)]
    print("$ python -m pytgi_bench.experiments.repeated_prompts " + shlex.join(sys.argv[1:]))
    print(f"workload: {asdict(workload)}")
    print("| prefix caching | peak blocks held | mean blocks held | preemptions | steps "
          "| cached prompt tokens | requests | outputs equal |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {'on' if r.prefix_caching else 'off'} | {r.peak_blocks} | {r.mean_blocks} "
              f"| {r.preemptions} | {r.steps} | {r.cached_prompt_tokens} | {r.requests} "
              f"| {r.outputs_equal} |")
    if args.out is not None:
        args.out.write_text(json.dumps(
            {"workload": asdict(workload), "results": [asdict(r) for r in results]}, indent=2))


if __name__ == "__main__":
    main()
