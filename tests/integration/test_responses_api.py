"""OpenAI's Responses API end to end: a real pytgi-router and shard on the tiny random Llama,
driven by the `openai` SDK and the `openai-agents` SDK. A Responses request is a chat request
told another way, so each answer is checked against chat completions given the same
conversation (greedy: the same tokens), and constrained outputs against their schemas."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import agents
import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.integration.structured_cases import SCHEMAS, TOOL_PROMPT, TOOL_TEMPLATE, WEATHER
from tests.router_process import RouterProcess
from tests.shard_process import ShardProcesses

N = 12
# The tool template, its generation prompt Qwen3's: the thinking closed unless the request sets
# `enable_thinking` (so the other tests' outputs are all answer).
TEMPLATE = TOOL_TEMPLATE.replace(
    "<|assistant|>\n{% endif %}",
    "<|assistant|>\n{% if enable_thinking %}<think>\n{% else %}<think></think>{% endif %}"
    "{% endif %}")
THINKING = {"chat_template_kwargs": {"enable_thinking": True}}
# The template opened <think>: the output thinks, closes it and answers (a Lark grammar holds
# the whole output, thinking included; a regex or a schema would hold only the answer).
THOUGHT = r'start: /[a-z]{2,6}( [a-z]{2,6}){1,2}/ "</think>" /[A-Z][a-z]{1,6}\./'
WEATHER_TOOL = {"type": "function", **WEATHER["function"]}
FORCED = {"type": "function", "name": "get_weather"}
EXTRA = {"tool_prompt": TOOL_PROMPT}


@pytest.fixture(scope="module")
def url(model: Path, shards: ShardProcesses, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[str]:
    config = json.loads((model / "tokenizer_config.json").read_text())
    path = tmp_path_factory.mktemp("config") / "tokenizer_config.json"
    path.write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    with RouterProcess(shards.urls[0], model, "--max-input-tokens", "120", "--max-total-tokens",
                       "256", "--tokenizer-config-path", str(path), "--served-model-name", "tiny",
                       "--reasoning-parser", "qwen3") as router:
        yield router.url


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def chat_text(client: openai.OpenAI, messages: list[Any]) -> str:
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=N,
                                         temperature=0)
    return out.choices[0].message.content or ""


def test_plain_is_the_chat_answer(client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny", instructions="Be brief.", input="Hello",
                                max_output_tokens=N, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    expected = chat_text(client, [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Hello"}])
    assert r.output_text == expected
    assert r.usage is not None and 0 < r.usage.output_tokens <= N
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.usage.output_tokens == N and r.status == "incomplete":
        assert r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    assert client.responses.retrieve(r.id).output_text == r.output_text


def test_streamed_events(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model="tiny", input="Hello", max_output_tokens=N,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == deltas == events[-4].text  # type: ignore[union-attr]
    whole = client.responses.create(model="tiny", input="Hello", max_output_tokens=N,
                                    temperature=0)
    assert whole.output_text.rstrip("\ufffd") == deltas.rstrip("\ufffd")
    assert final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_reasoning_item_then_the_answer(client: openai.OpenAI) -> None:
    """With --reasoning-parser and a template that opened the thinking, a Lark grammar makes
    the model think and answer: a reasoning item, then the message; streamed as
    `response.reasoning_text.delta` first."""
    kwargs: dict[str, Any] = dict(model="tiny", input="Two plus two?", max_output_tokens=60,
                                  temperature=0, text={"format": {"type": "lark",
                                                                  "value": THOUGHT}},
                                  extra_body=THINKING)
    r = client.responses.create(**kwargs)
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert reasoning.content is not None
    assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){1,2}", reasoning.content[0].text)
    assert re.fullmatch(r"[A-Z][a-z]{1,6}\.", r.output_text)
    assert r.usage is not None
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    events = list(client.responses.create(**kwargs, stream=True))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, answer) == (reasoning.content[0].text, r.output_text)


def test_a_streamed_response_is_stored_as_it_goes(url: str, client: openai.OpenAI) -> None:
    """GET shows a streamed response in progress, then as it ended; one whose client left
    is cancelled."""
    body = {"model": "tiny", "input": "Tell", "max_output_tokens": 150, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=60) as r:
        lines = r.iter_lines()
        created = json.loads(next(line for line in lines if line.startswith("data:"))[5:])
        response_id = created["response"]["id"]
        assert client.responses.retrieve(response_id).status == "in_progress"
        for _ in lines:
            pass
    assert client.responses.retrieve(response_id).status in ("completed", "incomplete")
    with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=60) as r:
        lines = r.iter_lines()
        left = json.loads(next(line for line in lines if line.startswith("data:"))[5:])
    for _ in range(100):
        status = client.responses.retrieve(left["response"]["id"]).status
        if status != "in_progress":
            break
        time.sleep(0.05)
    assert status == "cancelled"


def test_forced_function_call_streamed_and_not(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model="tiny", input="Weather in Paris?", tools=[WEATHER_TOOL],
                                  tool_choice=FORCED, max_output_tokens=80, temperature=0,
                                  extra_body=EXTRA)
    r = client.responses.create(**kwargs)
    assert r.status == "completed", r
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    events = list(client.responses.create(**kwargs, stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == done.arguments == call.arguments
    assert events[-1].type == "response.completed"


class Code(pydantic.BaseModel):
    code: Literal["ab", "cd"]
    n: int = pydantic.Field(ge=0, le=99)


def test_json_schema_format(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(model="tiny", input="Give a code.", text_format=Code,
                                    max_output_tokens=60, temperature=0)
    assert isinstance(parsed.output_parsed, Code)
    # The SDK's stream helper checks the events' items against each other as it accumulates.
    with client.responses.stream(model="tiny", input="Give a code.", text_format=Code,
                                 max_output_tokens=60, temperature=0) as helper:
        assert helper.get_final_response().output_parsed == parsed.output_parsed
    schema = SCHEMAS["string_bounds"]
    r = client.responses.create(
        model="tiny", input="Give a code.", max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "code", "schema": schema,
                         "strict": True}})
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), schema)


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(model="tiny", input="Hi", max_output_tokens=N,
                                    temperature=0)
    second = client.responses.create(model="tiny", input="More", previous_response_id=first.id,
                                     max_output_tokens=N, temperature=0)
    assert second.previous_response_id == first.id
    expected = chat_text(client, [{"role": "user", "content": "Hi"},
                                  {"role": "assistant", "content": first.output_text},
                                  {"role": "user", "content": "More"}])
    assert second.output_text == expected
    [listed] = client.responses.input_items.list(second.id).data
    assert listed.type == "message" and listed.content[0].text == "More"  # type: ignore[union-attr]
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(second.id)
    assert err.value.body["type"] == "not_found_error"  # type: ignore[index]


def test_tool_round_trip(client: openai.OpenAI) -> None:
    """function_call → function_call_output through previous_response_id: the tool's output
    is in the prompt of the answer (the input grew by it)."""
    call = client.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER_TOOL],
                                   tool_choice=FORCED, max_output_tokens=80, temperature=0,
                                   extra_body=EXTRA)
    [item] = call.output
    assert item.type == "function_call"
    answer = client.responses.create(
        model="tiny", previous_response_id=call.id, tools=[WEATHER_TOOL], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": item.call_id, "output": "sunny 21C"}],
        max_output_tokens=N, temperature=0)
    assert answer.output[0].type == "message"
    assert answer.usage is not None and call.usage is not None
    assert answer.usage.input_tokens > call.usage.input_tokens + len("sunny 21C") // 4


def test_one_agent_turn_with_a_function_tool(url: str) -> None:
    """openai-agents runs one turn through /v1/responses, plain and streamed: the model
    (forced) calls the tool, the SDK runs it, and its result is the turn's output."""
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"], unit: Literal["C", "F"]) -> str:
        """Current weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    agents.set_tracing_disabled(True)
    model = agents.OpenAIResponsesModel(
        model="tiny", openai_client=openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused"))
    agent = agents.Agent(
        name="weather", instructions="Answer.", model=model, tools=[get_weather],
        tool_use_behavior="stop_on_first_tool",
        model_settings=agents.ModelSettings(tool_choice="get_weather", temperature=0,
                                            max_tokens=120, extra_body=EXTRA))

    async def both() -> tuple[Any, Any, list[str]]:
        """One turn, then the same turn streamed (one event loop: the client is bound to it)."""
        result = await agents.Runner.run(agent, "Weather in Paris?", max_turns=2)
        run = agents.Runner.run_streamed(agent, "Weather in Paris?", max_turns=2)
        kinds = [e.type async for e in run.stream_events()]
        return result.final_output, run.final_output, kinds

    final, streamed, kinds = asyncio.run(both())
    assert len(seen) == 2 and final == f"sunny in {seen[0]}"
    assert "raw_response_event" in kinds and streamed == final  # greedy: the same call


@pytest.mark.parametrize(("body", "status", "param", "code"), [
    ({"model": "tiny"}, 422, "input", "validation"),
    ({"input": [{"type": "web_search_call"}]}, 422, "input[0].type", "validation"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 422, "tools[0].type", "validation"),
    ({"input": "x", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}},
     422, None, "tool_error"),
    ({"input": "x " * 400}, 422, "input", "validation"),
    ({"input": "x", "previous_response_id": "resp_gone"}, 404, "previous_response_id",
     "not_found"),
    ({"input": "x", "background": True, "stream": True}, 422, "background", "validation"),
])
def test_errors_in_openai_shape(url: str, body: dict[str, Any], status: int, param: str | None,
                                code: str) -> None:
    r = httpx.post(f"{url}/v1/responses", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == code, error
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert isinstance(error["message"], str) and error["message"]


def wait(client: openai.OpenAI, response_id: str) -> Any:
    for _ in range(600):
        r = client.responses.retrieve(response_id)
        if r.status not in ("queued", "in_progress"):
            return r
        time.sleep(0.05)
    raise AssertionError(f"{response_id} still {r.status}")


def test_background_runs_and_cancel(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model="tiny", input="Hello", max_output_tokens=N,
                                  temperature=0)
    started = client.responses.create(**kwargs, background=True)
    assert started.status == "in_progress" and started.background
    done = wait(client, started.id)
    assert done.output_text == client.responses.create(**kwargs).output_text
    assert client.responses.cancel(started.id).status == done.status  # already ended: as is
    long = client.responses.create(model="tiny", input="Tell", max_output_tokens=200,
                                   temperature=0, background=True)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.id == long.id
    assert client.responses.retrieve(long.id).status == "cancelled"
    deleted = client.responses.create(model="tiny", input="Tell", max_output_tokens=200,
                                      temperature=0, background=True)
    client.responses.delete(deleted.id)  # stops the run: its end does not store it again
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(deleted.id)


def test_get_cancel_and_malformed(url: str, client: openai.OpenAI) -> None:
    assert httpx.get(f"{url}/v1/responses/resp_nope").status_code == 404
    r = client.responses.create(model="tiny", input="Hi", max_output_tokens=2, store=False)
    assert httpx.get(f"{url}/v1/responses/{r.id}").status_code == 404
    stored = client.responses.create(model="tiny", input="Hi", max_output_tokens=2)
    assert httpx.get(f"{url}/v1/responses/{stored.id}?stream=true").status_code == 400
    cancel = httpx.post(f"{url}/v1/responses/{stored.id}/cancel")
    assert cancel.status_code == 400 and "background" in cancel.json()["error"]["message"]
    bad = httpx.post(f"{url}/v1/responses", content=b"{not json",
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    # The framework's 404 and 405 on these paths are in OpenAI's shape too.
    for r in (httpx.put(f"{url}/v1/responses"), httpx.get(f"{url}/v1/responses/a/b")):
        assert r.status_code in (404, 405) and isinstance(r.json()["error"], dict), r.text
