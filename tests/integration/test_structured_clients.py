"""Structured output with the clients people use (issue 14): the OpenAI SDK (`response_format`,
`parse` with a pydantic model, `tools`, its streaming helper that accumulates tool-call deltas),
huggingface_hub's InferenceClient (`text_generation(grammar=...)`, `chat_completion(tools=...)`)
and the `text-generation` client's grammar — against a real pytgi-router and shard on the tiny
random Llama, whose outputs are valid only by the grammar's doing."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest
from huggingface_hub import InferenceClient
from text_generation import Client
from text_generation.types import Grammar, GrammarType

from tests.integration.structured_cases import (
    LIMITS,
    MESSAGES,
    PARAMETERS,
    REGEXES,
    SCHEMAS,
    TOOL_PROMPT,
    TOOL_TEMPLATE,
    TOOLS,
)
from tests.router_process import RouterProcess
from tests.shard_process import start_shards

MAX_NEW = 160
SEEDS = range(4)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=5)
    size: Literal["small", "big"]


@pytest.fixture(scope="module")
def url(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[str]:
    model = tiny_model("llama")
    config = json.loads((model / "tokenizer_config.json").read_text())
    path = tmp_path_factory.mktemp("clients") / "tokenizer_config.json"
    path.write_text(json.dumps({**config, "chat_template": TOOL_TEMPLATE}))
    with start_shards(model) as shards, RouterProcess(
            shards.urls[0], model, *LIMITS, "--tokenizer-config-path", str(path)) as router:
        yield router.url


@pytest.fixture(scope="module")
def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="-", timeout=120)


def test_openai_response_format_and_parse(oai: openai.OpenAI) -> None:
    schema = SCHEMAS["enum_and_bounded_array"]
    ended = 0
    for seed in SEEDS:
        out = oai.chat.completions.create(
            model="tgi", messages=MESSAGES, max_tokens=MAX_NEW, seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "tags", "schema": schema, "strict": True}})
        if out.choices[0].finish_reason == "stop":
            ended += 1
            jsonschema.validate(json.loads(out.choices[0].message.content or ""), schema)
        obj = oai.chat.completions.create(
            model="tgi", messages=MESSAGES, max_tokens=MAX_NEW, seed=seed,
            response_format={"type": "json_object"})
        if obj.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    assert ended * 2 >= len(SEEDS)
    parsed = [oai.chat.completions.parse(model="tgi", messages=MESSAGES,
                                         max_tokens=MAX_NEW, seed=seed, response_format=City)
              for seed in SEEDS]
    cities = [p.choices[0].message.parsed for p in parsed if p.choices[0].finish_reason == "stop"]
    assert len(cities) * 2 >= len(SEEDS)
    assert all(isinstance(c, City) and len(c.name) <= 5 for c in cities)


def test_openai_tools_and_streamed_tool_calls(oai: openai.OpenAI) -> None:
    for seed in SEEDS:
        out = oai.chat.completions.create(
            model="tgi", messages=MESSAGES, max_tokens=MAX_NEW, seed=seed,
            tools=TOOLS, tool_choice="required",
            extra_body={"tool_prompt": TOOL_PROMPT})
        choice = out.choices[0]
        if choice.finish_reason == "length":
            continue
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        call = choice.message.tool_calls[0]
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments),
                            PARAMETERS[call.function.name])
        with oai.chat.completions.stream(
                model="tgi", messages=MESSAGES, max_tokens=MAX_NEW,
                seed=seed, tools=TOOLS, tool_choice="required",
                extra_body={"tool_prompt": TOOL_PROMPT}) as stream:
            final = stream.get_final_completion()
        [streamed] = final.choices[0].message.tool_calls or []
        assert final.choices[0].finish_reason == "tool_calls"
        assert final.choices[0].message.role == "assistant"
        assert streamed.function.name == call.function.name
        assert json.loads(streamed.function.arguments) == json.loads(
            call.function.arguments)
        assert streamed.id.startswith("call_")


def test_inference_client_grammar_and_tools(url: str) -> None:
    client = InferenceClient(model=url, timeout=120)
    schema = SCHEMAS["string_bounds"]
    for seed in SEEDS:
        out = client.text_generation(
            "JSON:", max_new_tokens=MAX_NEW, seed=seed, do_sample=True, details=True,
            return_full_text=False,
            grammar={"type": "json", "value": schema})  # type: ignore[call-overload]
        if out.details is not None and out.details.finish_reason == "eos_token":
            jsonschema.validate(json.loads(out.generated_text), schema)
    ended = 0
    for seed in SEEDS:
        chat = client.chat_completion(MESSAGES, max_tokens=MAX_NEW, seed=seed, tools=TOOLS,
                                      tool_choice="required", tool_prompt=TOOL_PROMPT)
        choice = chat.choices[0]
        if choice.finish_reason != "tool_calls":
            continue
        ended += 1
        call = (choice.message.tool_calls or [])[0]
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
        chunks = list(client.chat_completion(MESSAGES, max_tokens=MAX_NEW, seed=seed, stream=True,
                                             tools=TOOLS, tool_choice="required",
                                             tool_prompt=TOOL_PROMPT))
        deltas = [c.choices[0].delta.tool_calls[0] for c in chunks
                  if c.choices and c.choices[0].delta.tool_calls]
        assert deltas[0].function.name == call.function.name and deltas[0].id.startswith("call_")
        assert json.loads("".join(d.function.arguments for d in deltas)) == json.loads(
            call.function.arguments)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert ended * 2 >= len(SEEDS)


def test_text_generation_client_grammar(url: str) -> None:
    client = Client(url, timeout=120)
    schema = SCHEMAS["any_of"]
    ended = []
    for seed in SEEDS:
        out = client.generate("JSON:", max_new_tokens=MAX_NEW, seed=seed, do_sample=True,
                              grammar=Grammar(type=GrammarType.Json, value=schema))
        if out.details.finish_reason == "eos_token":
            ended.append(out.generated_text)
        regex = client.generate("Code:", max_new_tokens=40, seed=seed, do_sample=True,
                                grammar=Grammar(type=GrammarType.Regex, value=REGEXES[1]))
        if regex.details.finish_reason == "eos_token":
            assert re.fullmatch(REGEXES[1], regex.generated_text)
    assert len(ended) * 2 >= len(SEEDS)
    for text in ended:
        jsonschema.validate(json.loads(text), schema)
