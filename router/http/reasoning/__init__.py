"""Reasoning output: the thinking a reasoning model writes before its answer, told apart from
the answer (`--reasoning-parser NAME`, named as vLLM names them: `deepseek_r1`, `qwen3`,
`gpt_oss`).

Each parser (`registry.reasoning_parser(name)`) makes a `Splitter` per response that reads the
output's text a delta at a time (tags may be split across tokens) and yields `Piece`s of kind
"reasoning" or "content"; `split_text` is the same machine run over a whole text, so a streamed
and an unstreamed answer can never disagree. `router/http/openai/chat_output.py` composes it with
tool calling: that composed stream is what chat completions, the Responses API and Anthropic's
Messages API all render.
"""

from pytgi_router.http.reasoning.pieces import Piece, ReasoningParser, Split, Splitter, split_text
from pytgi_router.http.reasoning.registry import (
    NO_PARSER,
    PARSER_NAMES,
    chosen_parser,
    detect_reasoning_parser,
    reasoning_parser,
)

__all__ = [
    "NO_PARSER",
    "PARSER_NAMES",
    "Piece",
    "ReasoningParser",
    "Split",
    "Splitter",
    "chosen_parser",
    "detect_reasoning_parser",
    "reasoning_parser",
    "split_text",
]
