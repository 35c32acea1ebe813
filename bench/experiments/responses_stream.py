"""A streamed Responses API answer's cost per token on the event loop (`ResponsesEncoder` over
`ChatOutputStream`), without and with a reasoning parser (`qwen3`: a reasoning item, then the
message), beside chat completions' encoders on the same tokens. Behind the decision to splice
each token's text into its item's pre-rendered delta event (responses_stream.py) rather than
build and serialize an event dict per token. The best of `--repeats` runs.

    python -m pytgi_bench.experiments.responses_stream --tokens 6000 --repeats 5
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from pytgi_bench.experiments.chat_stream import encoders, per_token_us, thinking_tokens
from pytgi_router.core.request_stream import Token, TokenInfo
from pytgi_router.http.openai.chat_output import ChatOutputStream
from pytgi_router.http.openai.response_object import ResponseHead
from pytgi_router.http.openai.responses_stream import ResponsesEncoder
from pytgi_router.http.reasoning import ReasoningParser, reasoning_parser
from pytgi_router.http.streaming import Encoder


def responses(parser: ReasoningParser | None) -> Callable[[], Encoder]:
    """A Responses encoder already past its `response.created` events."""
    def make() -> Encoder:
        enc = ResponsesEncoder(ResponseHead({"model": "m"}), ChatOutputStream(parser, "", None),
                               5, lambda response: None)
        enc.start()
        return enc
    return make


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=6000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    thinking = thinking_tokens(args.tokens)
    plain = [Token(TokenInfo(i, f" w{i % 40}", -0.1, False)) for i in range(args.tokens)]
    rows: dict[str, tuple[Callable[[], Encoder], list[Token]]] = {
        f"chat: {name}": (make, thinking) for name, make in encoders().items()}
    rows["responses, no parser"] = (responses(None), plain)
    rows["responses, qwen3"] = (responses(reasoning_parser("qwen3")), thinking)
    print(f"| path | us/token (~{args.tokens} tokens, best of {args.repeats}) |")
    print("| --- | --- |")
    for name, (make, tokens) in rows.items():
        print(f"| {name} | {per_token_us(make, tokens, args.repeats):.2f} |")


if __name__ == "__main__":
    main()
