"""A streamed chat's cost per token on the event loop, by the path its tokens take: the plain
path (`ChatEncoder`: each token spliced into a pre-rendered chunk), and the shared output path
(`OutputChatEncoder` over `ChatOutputStream`) without a reasoning parser (a tool chat) and with
one (`qwen3`, half thinking, half answer). Linear by construction (each token is read once), so
the per-token time does not depend on the length; the best of `--repeats` runs.

    python -m pytgi_bench.experiments.chat_stream --tokens 6000 --repeats 5
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from pytgi_router.core.request_stream import Token, TokenInfo
from pytgi_router.http.openai.chat_output import ChatOutputStream
from pytgi_router.http.openai.chat_render import ChatEncoder, OutputChatEncoder
from pytgi_router.http.openai.schemas import Envelope
from pytgi_router.http.openai.stream import ChatChunks
from pytgi_router.http.reasoning import reasoning_parser
from pytgi_router.http.streaming import Encoder

ENV = Envelope("m", "fp")


def thinking_tokens(n: int) -> list[Token]:
    """`<think>`, n/2 words of thinking, `</think>`, n/2 words of answer."""
    words = [Token(TokenInfo(i, f" w{i % 40}", -0.1, False)) for i in range(n // 2)]
    return [Token(TokenInfo(0, "<think>", -0.1, False)), *words,
            Token(TokenInfo(1, "</think>", -0.1, False)), *words]


def encoders() -> dict[str, Callable[[], Encoder]]:
    qwen3 = reasoning_parser("qwen3")
    return {
        "plain (ChatEncoder)": lambda: ChatEncoder(ChatChunks(ENV, False), False, 5),
        "shared path, no parser": lambda: OutputChatEncoder(
            ChatChunks(ENV, False), False, 5, ChatOutputStream(None, "", None), False),
        "shared path, qwen3": lambda: OutputChatEncoder(
            ChatChunks(ENV, False), False, 5, ChatOutputStream(qwen3, "", None), True),
    }


def per_token_us(make: Callable[[], Encoder], tokens: list[Token], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        enc = make()
        start = time.perf_counter()
        for i, ev in enumerate(tokens):
            enc.token(i, ev)
        best = min(best, time.perf_counter() - start)
    return best / len(tokens) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=6000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    tokens = thinking_tokens(args.tokens)
    print(f"| path | us/token ({len(tokens)} tokens, best of {args.repeats}) |")
    print("| --- | --- |")
    for name, make in encoders().items():
        print(f"| {name} | {per_token_us(make, tokens, args.repeats):.2f} |")


if __name__ == "__main__":
    main()
