"""Issue 11 item 6: one request that the shard refuses (INVALID_ARGUMENT: a token id beyond the
model's vocabulary) fails alone; the running batch keeps decoding. The router now refuses such ids
itself (422); with its check off, the shard's refusal is what a newcomer meets."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from pytgi_router.core.errors import GenerationError, ValidationError
from pytgi_router.core.infer import Infer
from pytgi_router.core.request import ValidRequest
from tests.integration.test_router_infer import Log, request, serving, settings
from tests.shard_process import ShardProcesses, start_shards
from tests.tiny_models import VOCAB_SIZE


@pytest.fixture(scope="module")
def llama(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def shard(llama: Path) -> Iterator[ShardProcesses]:
    with start_shards(llama) as processes:
        yield processes


@pytest.fixture(scope="module")
def tokenizer(llama: Path) -> Tokenizer:
    return Tokenizer.from_file(str(llama / "tokenizer.json"))


def beyond_vocabulary(tokenizer: Tokenizer) -> ValidRequest:
    bad = request(tokenizer, "Hello world!", 5)
    bad.input_ids = [*bad.input_ids, VOCAB_SIZE + 3]
    bad.truncate = len(bad.input_ids)
    return bad


def test_the_router_refuses_ids_beyond_the_vocabulary(
    shard: ShardProcesses, tokenizer: Tokenizer
) -> None:
    async def main() -> None:
        async with serving(shard, settings()) as infer:
            assert infer.info.vocab_size == VOCAB_SIZE
            with pytest.raises(ValidationError, match=f"token id {VOCAB_SIZE + 3}, outside the "
                                                      f"model's vocabulary of {VOCAB_SIZE}"):
                infer.submit(beyond_vocabulary(tokenizer))
            assert infer.in_flight == 0

    asyncio.run(main())


def test_a_running_stream_survives_a_newcomer_the_shard_refuses(
    shard: ShardProcesses, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        async with serving(shard, settings()) as infer:
            # The router's own check off: the shard's INVALID_ARGUMENT is what the newcomer meets.
            monkeypatch.setattr(Infer, "_check_vocabulary", lambda self, request: None)
            log = Log()
            running = infer.submit(request(tokenizer, "The quick brown fox", 40))
            head = await log.read(0, running, limit=2)
            rest = asyncio.ensure_future(log.read(0, running, ids=head))
            with pytest.raises(GenerationError, match="not below the vocabulary size"):
                await log.read(1, infer.submit(beyond_vocabulary(tokenizer)))
            assert len(await rest) == 40
            # The scheduler is healthy and serves newcomers again.
            after = await log.read(2, infer.submit(request(tokenizer, "Hello world!", 3)))
            assert len(after) == 3
            assert infer.in_flight == 0 and infer.kv_blocks_free == infer.kv_blocks_total
            sample = infer.metrics.registry.get_sample_value
            assert sample("tgi_batch_inference_failure", {"method": "prefill"}) == 1
            assert sample("tgi_batch_inference_failure", {"method": "decode"}) == 0

    asyncio.run(main())
