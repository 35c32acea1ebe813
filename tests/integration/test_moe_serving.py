"""Mixtures of experts under continuous batching: requests that join a running batch on two
`pytgi-shard serve` ranks (concatenation) and leave it (filtering) get their solo tokens.

An MoE block routes each token on its own and groups tokens by expert across the whole batch,
so a request's neighbours change which tokens share an expert's matmul, never the result. The
three MoE families share that code; Qwen2-MoE, which also has a shared expert and a dense layer,
stands for them here (each ~10 s on 2 busy cores). Greedy tokens equal to transformers' on 1 rank
over gRPC and 2 through the launcher, two prompts of different lengths batched, for every
family: test_model_families_serving.py, tests/e2e/test_model_families_launcher.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer

from tests.integration.test_router_infer import Log, request, serving, settings, solo
from tests.shard_process import ShardProcesses, start_shards


def test_requests_joining_and_leaving_get_their_solo_tokens(
    tiny_model: Callable[..., Path],
) -> None:
    path = tiny_model("qwen2_moe")
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    # Long enough that the newcomers join while it runs, though a decode call may run several
    # steps before they are admitted (multi-step decode, --max-decode-steps 4 by default).
    long_req = request(tokenizer, "The quick brown fox jumps over the lazy dog", 24)
    joiners = [
        request(tokenizer, "Hello world!", 3),
        request(tokenizer, "Paged attention stores keys and values in blocks", 5),
    ]

    async def main(shards: ShardProcesses) -> None:
        async with serving(shards, settings()) as infer:
            alone = [await solo(infer, r) for r in (long_req, *joiners)]
            log = Log()
            long_stream = infer.submit(long_req)
            head = await log.read(0, long_stream, limit=2)
            rest = asyncio.ensure_future(log.read(0, long_stream, ids=head))
            joined = await asyncio.gather(
                *(log.read(i + 1, infer.submit(r)) for i, r in enumerate(joiners))
            )
            assert [await rest, *joined] == alone
            # The newcomers joined mid-generation and left (filtered out) before the long one.
            assert log.position(0, 2) < log.position(1, 1)
            assert log.position(1, 3) < log.position(0, 24) and log.position(2, 5) < log.position(0, 24)
            concat = infer.metrics.registry.get_sample_value(
                "tgi_batch_concat", {"reason": "backpressure"}
            )
            assert concat is not None and concat >= 1

    with start_shards(path, world_size=2) as shards:
        asyncio.run(main(shards))
