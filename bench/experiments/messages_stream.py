"""A streamed Anthropic message's cost per token on the event loop (`MessageEncoder` over the
shared chat output path), beside chat completions' encoder on the same tokens: without a
reasoning parser, with `qwen3` (half thinking, half answer), and with stop sequences (the text
that may begin one is held back and checked per token). The best of `--repeats` runs.

    python -m pytgi_bench.experiments.messages_stream --tokens 6000 --repeats 5
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from pytgi_bench.experiments.chat_stream import ENV, per_token_us, thinking_tokens
from pytgi_router.http.anthropic.events import MessageEvents
from pytgi_router.http.anthropic.stream import MessageEncoder
from pytgi_router.http.openai.chat_output import ChatOutputStream
from pytgi_router.http.openai.chat_render import OutputChatEncoder
from pytgi_router.http.openai.stream import ChatChunks
from pytgi_router.http.reasoning import ReasoningParser, reasoning_parser
from pytgi_router.http.streaming import Encoder


def message(parser: ReasoningParser | None, stops: list[str]) -> Callable[[], Encoder]:
    return lambda: MessageEncoder(MessageEvents("msg", "m", 5),
                                  ChatOutputStream(parser, "", None), stops)


def encoders() -> dict[str, Callable[[], Encoder]]:
    qwen3 = reasoning_parser("qwen3")
    return {
        "chat completions, shared path, no parser": lambda: OutputChatEncoder(
            ChatChunks(ENV, False), False, 5, ChatOutputStream(None, "", None), False),
        "messages, no parser": message(None, []),
        "messages, qwen3": message(qwen3, []),
        "messages, 1 stop sequence of 8 characters": message(None, ["zzzzzzzz"]),
        "messages, 4 stop sequences of 512 characters": message(None, [" w" + "z" * 510] * 4),
    }


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
