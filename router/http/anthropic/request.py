"""An Anthropic Messages body read as the chat request it stands for.

There is one chat path: the body is rewritten as the OpenAI chat body it means (system first,
`tool_use` blocks as an assistant's `tool_calls`, `tool_result` blocks as `tool` messages,
`tools` as functions, `tool_choice` in OpenAI's words) and parsed by the chat route's own
`parse_chat`, so validation, the template's messages, the tool grammar and the sampling fields
are the chat route's. What chat has no field for (`top_k`) is read by its row of the parameter
table, as TGI's /generate reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pytgi_proto.parameters import BY_NAME
from pytgi_router.core.errors import ValidationError
from pytgi_router.http.json_fields import (
    obj,
    opt_bool,
    opt_obj,
    req_str,
    required,
    str_list,
    wrong_type,
)
from pytgi_router.http.openai.schemas import ChatRequest, parse_chat
from pytgi_router.http.schemas import GenerateParameters, reader

# Fields the chat body takes as they are: Anthropic's sampling fields, which OpenAI spells the
# same, and TGI's extensions a client may add (`seed`, `tool_prompt`).
SAME_FIELDS = ("max_tokens", "temperature", "top_p", "stream", "seed", "tool_prompt")
# `tool_choice.type` in OpenAI's words.
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# Assistant blocks that carry no text for the template: earlier thinking is not replayed.
SKIPPED_BLOCKS = frozenset({"thinking", "redacted_thinking"})


@dataclass(slots=True)
class MessagesRequest:
    """The chat request an Anthropic body stands for, and what only Anthropic's answer needs."""

    chat: ChatRequest
    model: str
    top_k: int | None

    @property
    def stop_sequences(self) -> list[str]:
        return self.chat.fields.stop

    @property
    def stream(self) -> bool:
        return self.chat.fields.stream

    def parameters(self) -> GenerateParameters:
        """The chat request's parameters and `top_k`, except at `temperature: 0`, which is
        greedy whatever else is set (TGI samples whenever a warper such as top_k is set)."""
        p = self.chat.parameters()
        if self.chat.fields.temperature != 0.0:
            p.top_k = self.top_k
        return p


def parse_messages(body: Any, *, counting: bool = False) -> MessagesRequest:
    """A /v1/messages body (`counting`: a /v1/messages/count_tokens body, which has no
    `max_tokens`)."""
    data = obj(body, "body")
    model = req_str(data, "model")
    if not counting:
        required(data, "max_tokens")
    opt_obj(data, "metadata")  # accepted (`user_id`); nothing here reads it
    return MessagesRequest(
        chat=parse_chat(chat_body(data)),
        model=model,
        top_k=reader(BY_NAME["top_k"])(data, "top_k", ""),
    )


def chat_body(data: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI chat body `data` means."""
    out: dict[str, Any] = {k: data[k] for k in SAME_FIELDS if k in data}
    out["model"] = data.get("model")
    out["messages"] = chat_messages(data)
    out["stop"] = str_list(data, "stop_sequences")
    if data.get("tools") is not None:
        out["tools"] = chat_tools(data["tools"])
    if data.get("tool_choice") is not None:
        out["tool_choice"] = chat_tool_choice(data["tool_choice"])
    response_format = _response_format(data)
    if response_format is not None:
        out["response_format"] = response_format
    kwargs = _template_kwargs(data)
    if kwargs is not None:
        out["chat_template_kwargs"] = kwargs
    return out


def _template_kwargs(data: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's `chat_template_kwargs` (an extension), with `thinking` as the templates of
    thinking models read it: `enable_thinking` false for "disabled", true otherwise."""
    kwargs = opt_obj(data, "chat_template_kwargs")
    thinking = _thinking(data)
    if thinking is None:
        return kwargs
    return {**(kwargs or {}), "enable_thinking": thinking != "disabled"}


def _response_format(data: dict[str, Any]) -> dict[str, Any] | None:
    """`output_config.format` (structured outputs: `{type: json_schema, schema}`) as chat's
    `response_format`, which the grammar machinery reads; `output_config.effort` is accepted
    and has no meaning here."""
    config = opt_obj(data, "output_config")
    fmt = opt_obj(config, "format", "output_config.") if config is not None else None
    if fmt is None:
        return None
    if fmt.get("type") != "json_schema":
        raise ValidationError('`output_config.format.type` must be "json_schema"')
    schema = obj(required(fmt, "schema", "output_config.format."), "output_config.format.schema")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def _thinking(data: dict[str, Any]) -> str | None:
    thinking = opt_obj(data, "thinking")
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise ValidationError('`thinking.type` must be "enabled", "disabled" or "adaptive"')
    return str(kind)


# ---- messages ------------------------------------------------------------------------------


def chat_messages(data: dict[str, Any]) -> list[dict[str, Any]]:
    """`system`, then each turn as the chat messages it holds."""
    raw = required(data, "messages")
    if not isinstance(raw, list):
        raise wrong_type("messages", "an array of messages", raw)
    if not raw:
        raise ValidationError("`messages` cannot be empty")
    out: list[dict[str, Any]] = []
    system = data.get("system")
    if system is not None:
        out.append({"role": "system", "content": _system(system)})
    for i, turn in enumerate(raw):
        out.extend(chat_turn(turn, f"messages[{i}]"))
    return out


def _system(value: Any) -> str | list[dict[str, Any]]:
    """A string, or text blocks (as chat's text parts, which the chat parser joins)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise wrong_type("system", "a string or an array of text blocks", value)
    return [_text_part(obj(b, f"system[{i}]"), f"system[{i}]") for i, b in enumerate(value)]


def chat_turn(value: Any, path: str) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: a user turn's `tool_result` blocks are `tool`
    messages (in their order among its other blocks); an assistant turn is one message, its
    `tool_use` blocks its `tool_calls`."""
    turn = obj(value, path)
    role = required(turn, "role", f"{path}.")
    if role not in ("user", "assistant"):
        raise ValidationError(f'`{path}.role` must be "user" or "assistant"')
    content = required(turn, "content", f"{path}.")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise wrong_type(f"{path}.content", "a string or an array of content blocks", content)
    blocks = [(obj(b, f"{path}.content[{j}]"), f"{path}.content[{j}]")
              for j, b in enumerate(content)]
    if role == "assistant":
        return [_assistant(blocks)]
    return _user(blocks)


def _assistant(blocks: list[tuple[dict[str, Any], str]]) -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for block, path in blocks:
        kind = block.get("type")
        if kind == "tool_use":
            calls.append(_tool_call(block, path))
        elif kind not in SKIPPED_BLOCKS:
            parts.append(_part(block, path))
    message: dict[str, Any] = {"role": "assistant", "content": parts if parts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[tuple[dict[str, Any], str]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for block, path in blocks:
        if block.get("type") != "tool_result":
            parts.append(_part(block, path))
            continue
        if parts:
            out.append({"role": "user", "content": parts})
            parts = []
        out.append(_tool_message(block, path))
    if parts or not out:
        out.append({"role": "user", "content": parts})
    return out


def _tool_call(block: dict[str, Any], path: str) -> dict[str, Any]:
    """A `tool_use` block as OpenAI's tool call (its `input` as the arguments' JSON text)."""
    call_id = req_str(block, "id", f"{path}.")
    name = req_str(block, "name", f"{path}.")
    arguments = obj(required(block, "input", f"{path}."), f"{path}.input")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _tool_message(block: dict[str, Any], path: str) -> dict[str, Any]:
    """A `tool_result` block as OpenAI's `tool` message answering the call of that id."""
    call_id = req_str(block, "tool_use_id", f"{path}.")
    opt_bool(block, "is_error", f"{path}.")
    content = block.get("content")
    if content is None or isinstance(content, str):
        return {"role": "tool", "tool_call_id": call_id, "content": content or ""}
    if not isinstance(content, list):
        raise wrong_type(f"{path}.content", "a string or an array of content blocks", content)
    parts = [_part(obj(b, f"{path}.content[{k}]"), f"{path}.content[{k}]")
             for k, b in enumerate(content)]
    return {"role": "tool", "tool_call_id": call_id, "content": parts}


def _part(block: dict[str, Any], path: str) -> dict[str, Any]:
    """A text or image block as chat's content part; any other kind is refused by name."""
    kind = block.get("type")
    if kind == "text":
        return _text_part(block, path)
    if kind == "image":
        # `where`: the image's place in this body, for chat's image errors.
        return {"type": "image_url", "image_url": {"url": _image_url(block, path)},
                "where": path}
    raise ValidationError(
        f"`{path}.type` {kind!r} is not supported here: text, image, tool_use (assistant) and "
        "tool_result (user) blocks are"
    )


def _text_part(block: dict[str, Any], path: str) -> dict[str, Any]:
    if block.get("type") != "text":
        raise ValidationError(f'`{path}.type` must be "text"')
    return {"type": "text", "text": req_str(block, "text", f"{path}.")}


def _image_url(block: dict[str, Any], path: str) -> str:
    """The image as the URL chat's image part carries (base64 data as a data URL)."""
    source = obj(required(block, "source", f"{path}."), f"{path}.source")
    kind = source.get("type")
    if kind == "url":
        return req_str(source, "url", f"{path}.source.")
    if kind == "base64":
        media = req_str(source, "media_type", f"{path}.source.")
        return f"data:{media};base64,{req_str(source, 'data', f'{path}.source.')}"
    raise ValidationError(f'`{path}.source.type` must be "base64" or "url"')


# ---- tools ---------------------------------------------------------------------------------


def chat_tools(value: Any) -> list[dict[str, Any]]:
    """Custom tools (`name`, `description`, `input_schema`) as OpenAI functions; Anthropic's
    server tools (web search, code execution...) run on Anthropic's side and are refused."""
    if not isinstance(value, list):
        raise wrong_type("tools", "an array of tools", value)
    return [_function(obj(t, f"tools[{i}]"), f"tools[{i}]") for i, t in enumerate(value)]


def _function(tool: dict[str, Any], path: str) -> dict[str, Any]:
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise ValidationError(
            f"`{path}.type` {kind!r} is a server tool, which this server does not run: only "
            "custom tools (name, description, input_schema) are served"
        )
    function: dict[str, Any] = {"name": req_str(tool, "name", f"{path}.")}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    function["parameters"] = obj(required(tool, "input_schema", f"{path}."), f"{path}.input_schema")
    return {"type": "function", "function": function}


def chat_tool_choice(value: Any) -> Any:
    """{type: auto | any | none} or {type: tool, name} in OpenAI's words."""
    choice = obj(value, "tool_choice")
    opt_bool(choice, "disable_parallel_tool_use", "tool_choice.")  # one call per answer anyway
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": req_str(choice, "name", "tool_choice.")}}
    if kind in TOOL_CHOICES:
        return TOOL_CHOICES[kind]
    raise ValidationError('`tool_choice.type` must be "auto", "any", "tool" or "none"')
