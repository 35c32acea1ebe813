"""PrepareGrammar through Infer and real shard processes: a constrained request is queued once
the shards compiled its grammar and its output follows it (a free request submitted alongside
runs as usual); a grammar the shards refuse in PrepareGrammar ends the request with a 422 (the
HTTP layer's own validation is bypassed here: only the RPC can refuse it, and a refusal in
Prefill would be a generation error) and gives its permit back."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from pytgi_proto.parameters import neutral_sampling
from pytgi_router.core.errors import ValidationError
from pytgi_router.core.request import StoppingParameters, ValidRequest
from pytgi_router.core.request_stream import End, RequestStream
from tests.integration.test_router_infer import serving, settings
from tests.shard_process import ShardProcesses, start_shards

REGEX = 2


@pytest.fixture(scope="module")
def shards(tiny_model: Callable[..., Path]) -> Iterator[ShardProcesses]:
    with start_shards(tiny_model("llama")) as processes:
        yield processes


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Callable[..., Path]) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model("llama") / "tokenizer.json"))


def constrained(tokenizer: Tokenizer, text: str, grammar: str) -> ValidRequest:
    ids = tokenizer.encode(text).ids
    sampling = neutral_sampling(grammar=grammar, grammar_type=REGEX)
    return ValidRequest(inputs=text, input_ids=ids, truncate=len(ids), sampling=sampling,
                        stopping=StoppingParameters(max_new_tokens=24))  # fmt: skip


def free_request(tokenizer: Tokenizer, text: str) -> ValidRequest:
    ids = tokenizer.encode(text).ids
    return ValidRequest(inputs=text, input_ids=ids, truncate=len(ids),
                        sampling=neutral_sampling(), stopping=StoppingParameters(max_new_tokens=8))  # fmt: skip


async def final_text(stream: RequestStream) -> str:
    async for event in stream:
        if isinstance(event, End):
            return event.generated_text
    raise AssertionError("the stream ended without End")


def test_constrained_requests_wait_for_their_grammar_and_bad_ones_get_422(
    shards: ShardProcesses, tokenizer: Tokenizer
) -> None:
    async def main() -> None:
        async with serving(shards, settings()) as infer:
            good = infer.submit(constrained(tokenizer, "Answer:", "(yes|no)!"))
            free = infer.submit(free_request(tokenizer, "Hello"))
            texts = await asyncio.gather(final_text(good), final_text(free))
            assert re.fullmatch("(yes|no)!", texts[0])
            bad = infer.submit(constrained(tokenizer, "Answer:", "(ab"))
            with pytest.raises(ValidationError, match="(?s)invalid grammar: .*unclosed group"):
                await final_text(bad)
            assert infer.in_flight == 0

    asyncio.run(main())
