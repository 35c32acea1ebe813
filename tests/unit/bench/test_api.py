"""Reading TGI and OpenAI stream payloads into a request's state (shapes from TGI's docs)."""

from __future__ import annotations

import json

from pytgi_bench.api import OpenAIChatApi, OpenAICompletionsApi, StreamState, TgiApi
from pytgi_bench.workload import WorkloadItem

ITEM = WorkloadItem(prompt="hello", input_tokens=3, max_new_tokens=4)


def _tgi_event(index: int, last: bool) -> bytes:
    details = {"finish_reason": "length", "generated_tokens": 2, "seed": None, "input_length": 3}
    return json.dumps(
        {
            "index": index,
            "token": {"id": 7, "text": "a", "logprob": -0.5, "special": False},
            "generated_text": "aa" if last else None,
            "details": details if last else None,
        }
    ).encode()


def test_tgi_payload_is_greedy_and_token_exact() -> None:
    body = TgiApi().payload(ITEM, "tgi", ignore_eos=False)
    assert body == {
        "inputs": "hello",
        "parameters": {"max_new_tokens": 4, "details": True, "do_sample": False, "stop": []},
    }
    assert TgiApi().payload(ITEM, "tgi", ignore_eos=True)["parameters"]["ignore_eos"] is True


def test_compact_intermediate_events_take_the_fast_path_and_count_the_same() -> None:
    compact = json.dumps(json.loads(_tgi_event(1, last=False)), separators=(",", ":")).encode()
    assert compact.endswith(b',"generated_text":null,"details":null}')
    fast, slow = StreamState(), StreamState()
    assert TgiApi().on_data(compact, fast) and TgiApi().on_data(_tgi_event(1, False), slow)
    assert fast == slow


def test_tgi_stream_counts_tokens_and_reads_details() -> None:
    api, state = TgiApi(), StreamState()
    assert api.on_data(_tgi_event(1, last=False), state)
    assert not state.done
    assert api.on_data(_tgi_event(2, last=True), state)
    assert state.done and state.chunks == 2
    assert (state.output_tokens, state.prompt_tokens, state.finish_reason) == (2, 3, "length")


def test_tgi_error_event_ends_the_stream_with_its_message() -> None:
    state = StreamState()
    data = b'{"error": "Request failed during generation: boom", "error_type": "generation"}'
    assert not TgiApi().on_data(data, state)
    assert state.done and state.error == "Request failed during generation: boom"


def test_openai_chat_stream_with_usage() -> None:
    api, state = OpenAIChatApi(), StreamState()
    chunk = {
        "object": "chat.completion.chunk",
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": "x"}, "finish_reason": None}
        ],
    }
    assert api.on_data(json.dumps(chunk).encode(), state)
    chunk["choices"][0]["finish_reason"] = "length"
    assert api.on_data(json.dumps(chunk).encode(), state)
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}
    assert not api.on_data(json.dumps(usage).encode(), state)
    assert not api.on_data(b"[DONE]", state)
    assert state.done and state.chunks == 2
    assert (state.output_tokens, state.prompt_tokens, state.finish_reason) == (2, 9, "length")
    body = api.payload(ITEM, "m", ignore_eos=False)
    assert body["messages"] == [{"role": "user", "content": "hello"}]
    assert body["max_tokens"] == 4 and body["temperature"] == 0.0 and body["stream"] is True


def test_openai_role_only_chunk_is_not_a_token() -> None:
    state = StreamState()
    opener = {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
    assert not OpenAIChatApi().on_data(json.dumps(opener).encode(), state)
    assert state.chunks == 0


def test_openai_completions_error_then_done() -> None:
    api, state = OpenAICompletionsApi(), StreamState()
    text = {"choices": [{"index": 0, "text": "y", "finish_reason": ""}]}
    assert api.on_data(json.dumps(text).encode(), state)
    error = {"error": {"message": "Input validation error: bad", "http_status_code": 422}}
    assert not api.on_data(json.dumps(error).encode(), state)
    api.on_data(b"[DONE]", state)
    assert state.error == "Input validation error: bad" and state.done
    assert api.payload(ITEM, "m", ignore_eos=True)["prompt"] == "hello"
