"""chat_render.py: chat completions' rendering of the shared output path — the message of a
whole turn and the stream's chunks, with the thinking as `reasoning_content`/`reasoning`, read
back with the OpenAI SDK's types."""

from __future__ import annotations

import json
from typing import Any

from openai.types.chat import ChatCompletionChunk

from pytgi_router.core.request_stream import End, Token, TokenInfo
from pytgi_router.http.openai.chat_output import ChatOutputStream, chat_answer
from pytgi_router.http.openai.chat_render import OutputChatEncoder, assistant_message
from pytgi_router.http.openai.schemas import Envelope
from pytgi_router.http.openai.stream import ChatChunks
from pytgi_router.http.reasoning import reasoning_parser

QWEN3 = reasoning_parser("qwen3")
EOS = TokenInfo(9, "</s>", -0.1, True)


def sse(data: bytes) -> list[Any]:
    events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def stream(pieces: list[str], finish_reason: str, offered: frozenset[str] | None = None,
           logprobs: bool = False) -> list[Any]:
    enc = OutputChatEncoder(ChatChunks(Envelope("m", "fp"), False), True, 5,
                            ChatOutputStream(QWEN3, "", offered), reasoning=True,
                            logprobs=logprobs)
    out = b"".join(enc.token(i + 1, Token(TokenInfo(i, p, -0.1, False)))
                   for i, p in enumerate(pieces))
    out += enc.end(len(pieces) + 1, End(EOS, generated_text="".join(pieces),
                                        finish_reason=finish_reason,
                                        generated_tokens=len(pieces) + 1))
    return sse(out)


def test_stream_thinking_deltas_then_the_answer() -> None:
    events = stream(["<thi", "nk>", "Hm", "m.", "</thi", "nk>\n\n", "Four", "."], "eos_token")
    assert events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(e) for e in events[:-1]]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and all(d.role is None for d in deltas[1:])
    reasoning = [(d.model_extra or {}).get("reasoning_content") for d in deltas]
    assert "".join(r for r in reasoning if r) == "Hmm."
    assert all((d.model_extra or {}).get("reasoning") == r for d, r in zip(deltas, reasoning,
                                                                          strict=True))
    assert "".join(d.content or "" for d in deltas) == "Four."
    last_thought = max(i for i, r in enumerate(reasoning) if r)
    assert all(not d.content for d in deltas[:last_thought + 1])  # no answer before the end
    assert chunks[-2].choices[0].finish_reason == "stop"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == 6  # the tags' tokens included


def test_streamed_logprobs_every_token_once_in_order() -> None:
    """A token that made no delta yet (half a tag) has its entry carried by the next chunk;
    the end of sequence's by the last."""
    pieces = ["<thi", "nk>", "Hm", "</think>", "Four"]
    events = stream(pieces, "eos_token", logprobs=True)
    chunks = [ChatCompletionChunk.model_validate(e) for e in events[:-1]]
    entries = [t.token for c in chunks if c.choices and c.choices[0].logprobs
               for t in c.choices[0].logprobs.content or []]
    assert entries == [*pieces, "</s>"]
    plain = stream(pieces, "eos_token")[:-1]
    assert all(e["choices"][0]["logprobs"] is None for e in plain if e["choices"])


def test_stream_cut_inside_the_thinking() -> None:
    events = stream(["<think>", "still"], "length")
    chunks = [ChatCompletionChunk.model_validate(e) for e in events[:-1]]
    assert all(not c.choices or not c.choices[0].delta.content for c in chunks)
    assert chunks[-2].choices[0].finish_reason == "length"


def test_message_of_a_whole_turn() -> None:
    toks = [TokenInfo(0, "<think>a</think>", 0.0, False), TokenInfo(1, "b", 0.0, False)]
    answer = chat_answer(QWEN3, "", None, toks, "<think>a</think>b", "eos_token")
    assert assistant_message(answer, reasoning=True) == {
        "role": "assistant", "content": "b", "reasoning_content": "a", "reasoning": "a"}
    cut = chat_answer(QWEN3, "", None, toks[:1], "<think>a", "length")
    assert assistant_message(cut, reasoning=True)["content"] is None
    plain = chat_answer(None, "", None, [EOS], "", "eos_token")
    assert assistant_message(plain, reasoning=False) == {"role": "assistant", "content": ""}
    call = '{"function": {"_name": "f", "x": 1}}'
    tool = chat_answer(QWEN3, "", frozenset({"f"}), [TokenInfo(0, "<think>t</think>" + call, 0.0,
                                                               False)],
                       "<think>t</think>" + call, "eos_token")
    message = assistant_message(tool, reasoning=True)
    assert message["content"] is None and message["reasoning_content"] == "t"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"x": 1}
