"""Streamed tool calls on the event loop: the time `ToolCallStream` takes per stream and per
token for outputs of growing length, so that a quadratic cost (every token re-reading the whole
text) shows as a per-token time that grows with the length.

A tool call whose arguments hold one long string, and a `no_tool` answer as long (text beyond
Latin-1, so Python stores 2 bytes a character, and JSON escapes), cut into tokens of 4
characters; the best of `--repeats` runs.

    python -m pytgi_bench.experiments.tool_stream --tokens 1024,8192,32768 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

from pytgi_router.http.openai.tool_stream import ToolCallStream

_TOKEN_CHARS = 4


@dataclass(frozen=True, slots=True)
class Timing:
    total_s: float
    max_push_ms: float
    last_push_ms: float


def output_text(kind: str, tokens: int) -> str:
    """A constrained output of about `tokens` tokens: a call's or no_tool's long string."""
    body = ("lorem ipsum 東京 \\u00e9 " * tokens)[: tokens * _TOKEN_CHARS]
    body = body[: body.rfind(" ")]  # never half an escape
    if kind == "call":
        return '{"function": {"_name": "write", "text": "' + body + '"}}'
    return '{"function": {"_name": "no_tool", "content": "' + body + '"}}'


def pieces_of(text: str) -> list[str]:
    return [text[i:i + _TOKEN_CHARS] for i in range(0, len(text), _TOKEN_CHARS)]


def one_stream(pieces: list[str], text: str) -> Timing:
    """Every push timed, then the finish (the stream's end) inside the total."""
    parser = ToolCallStream()
    slowest, last = 0.0, 0.0
    start = time.perf_counter()
    for piece in pieces[:-1]:
        t = time.perf_counter()
        parser.push(piece)
        last = time.perf_counter() - t
        slowest = max(slowest, last)
    parser.finish(pieces[-1], text)
    return Timing(time.perf_counter() - start, slowest * 1e3, last * 1e3)


def best(kind: str, tokens: int, repeats: int) -> Timing:
    text = output_text(kind, tokens)
    pieces = pieces_of(text)
    return min((one_stream(pieces, text) for _ in range(repeats)), key=lambda t: t.total_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1024,8192,32768",
                        help="comma-separated output lengths in tokens")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    print(f"{'output':>8} {'tokens':>7} {'stream s':>9} {'us/token':>9} {'max push ms':>12} "
          f"{'last push ms':>13}")
    for kind in ("call", "no_tool"):
        for tokens in (int(n) for n in args.tokens.split(",")):
            t = best(kind, tokens, args.repeats)
            print(f"{kind:>8} {tokens:>7} {t.total_s:>9.3f} {t.total_s / tokens * 1e6:>9.1f} "
                  f"{t.max_push_ms:>12.3f} {t.last_push_ms:>13.3f}")
            rows.append({"output": kind, "tokens": tokens, "stream_s": t.total_s,
                         "max_push_ms": t.max_push_ms, "last_push_ms": t.last_push_ms})
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
