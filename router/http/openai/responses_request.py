"""A `POST /v1/responses` body read as the chat request it means: `instructions` and the
`input` items (messages, function calls and their outputs) become chat messages after the stored
conversation `previous_response_id` names; function `tools`, `tool_choice`, `text.format` and
the sampling fields become their chat spellings; and the whole goes through `parse_chat`, so a
Responses request is validated, templated, constrained and generated exactly as a chat one.

What the Responses API has and this server cannot do (hosted tools, stored prompts,
conversations, files, a background run that streams) is refused by name rather than ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pytgi_router.core.errors import ValidationError
from pytgi_router.http.http_errors import ToolError
from pytgi_router.http.json_fields import (
    obj,
    opt_bool,
    opt_int,
    opt_obj,
    opt_str,
    req_str,
    wrong_type,
)
from pytgi_router.http.openai.response_input_items import listed_items
from pytgi_router.http.openai.schemas import ChatRequest, parse_chat

# Fields whose feature this server does not have: each is refused with its reason.
UNSUPPORTED = {
    "conversation": "conversations are not stored here; chain with `previous_response_id`",
    "prompt": "stored prompt templates are not supported",
}
# Accepted and repeated in the response object, changing nothing in the generation.
ECHOED = ("metadata", "user", "safety_identifier", "prompt_cache_key", "service_tier")
# pytgi's extensions, read as chat reads them (determinism, the tool prompt's text, the chat
# template's variables such as `enable_thinking`).
EXTENSIONS = ("seed", "tool_prompt", "chat_template_kwargs")


@dataclass(slots=True)
class ResponsesRequest:
    """The chat request to run, the conversation to store after it (without the
    instructions), and the request's fields that the response object repeats."""

    chat: ChatRequest
    conversation: list[dict[str, Any]]
    echo: dict[str, Any]
    stream: bool
    store: bool
    background: bool = False
    # The input as GET .../input_items lists it.
    input_items: list[dict[str, Any]] = field(default_factory=list)


def parse_responses(
    data: dict[str, Any], history: list[dict[str, Any]], model: str
) -> ResponsesRequest:
    """`data` continued after `history` (the stored conversation of `previous_response_id`,
    [] without one); `model` is what the response reports when the body names none."""
    _refuse_unsupported(data)
    new = input_messages(data.get("input"), history)
    if not new:
        raise ValidationError("`input` must hold at least one message or item")
    conversation = [*history, *new]
    instructions = opt_str(data, "instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    tools = [_chat_tool(t, i) for i, t in enumerate(_list(data, "tools"))]
    offered, choice = offered_tools(tools, data.get("tool_choice"))
    body: dict[str, Any] = {
        "messages": [*system, *conversation],
        "max_tokens": opt_int(data, "max_output_tokens"),
        "temperature": data.get("temperature"),
        "top_p": data.get("top_p"),
        "tools": offered or None,
        "tool_choice": choice,
        "response_format": response_format(opt_obj(data, "text")),
        **{k: data[k] for k in EXTENSIONS if k in data},
    }
    stream = bool(opt_bool(data, "stream"))
    store = opt_bool(data, "store") is not False
    background = _background(data, stream, store)
    echo = _echo(data, model, tools, store)
    echo["background"] = background
    chat = parse_chat(body)
    return ResponsesRequest(chat, conversation, echo, stream, store, background,
                            listed_items(data.get("input")))


def _refuse_unsupported(data: dict[str, Any]) -> None:
    for key, why in UNSUPPORTED.items():
        if data.get(key) is not None:
            raise ValidationError(f"`{key}` is not supported: {why}")


def _background(data: dict[str, Any], stream: bool, store: bool) -> bool:
    """A background response is polled by id, so it must be stored; one that is also streamed
    is not supported (stream it, or poll it)."""
    background = bool(opt_bool(data, "background"))
    if background and not store:
        raise ValidationError("`background` needs `store`: a background response is read by id")
    if background and stream:
        raise ValidationError("`background` with `stream` is not supported: stream the "
                              "response, or run it in the background and poll it by id")
    return background


def _list(data: dict[str, Any], key: str) -> list[Any]:
    value = data.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise wrong_type(key, "an array", value)
    return value


def _echo(data: dict[str, Any], model: str, tools: list[dict[str, Any]], store: bool
          ) -> dict[str, Any]:
    """The request's fields as the response object repeats them (OpenAI's defaults filled)."""
    text = opt_obj(data, "text") or {}
    out: dict[str, Any] = {
        "model": opt_str(data, "model") or model,
        "instructions": data.get("instructions"),
        "max_output_tokens": data.get("max_output_tokens"),
        "parallel_tool_calls": opt_bool(data, "parallel_tool_calls") is not False,
        "previous_response_id": data.get("previous_response_id"),
        "reasoning": opt_obj(data, "reasoning") or {"effort": None, "summary": None},
        "store": store,
        "temperature": data.get("temperature", 1.0),
        "top_p": data.get("top_p", 1.0),
        "text": {**text, "format": text.get("format") or {"type": "text"}},
        "tool_choice": data.get("tool_choice") or "auto",
        "tools": [_echoed_tool(t) for t in tools],
        "truncation": "disabled",
    }
    out.update({k: data.get(k) for k in ECHOED})
    out["metadata"] = out["metadata"] or {}
    return out


def _echoed_tool(chat_tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool in the Responses form (the response's `tools`)."""
    f = chat_tool["function"]
    return {"type": "function", "name": f["name"], "description": f.get("description"),
            "parameters": f.get("parameters"), "strict": True}


# ---- input ---------------------------------------------------------------------------------------


def input_messages(value: Any, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages: a string is one user message; items in order, a function call
    joining the assistant message before it, its output a `tool` message (named after the call,
    which must be in this input or the history before it, as OpenAI requires)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise wrong_type("input", "a string or an array of input items", value)
    calls = _call_names(history)
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        _add_item(out, obj(item, f"input[{i}]"), f"input[{i}]", calls)
    return out


def _call_names(messages: list[dict[str, Any]]) -> dict[str, str]:
    """call_id → function name of every tool call in `messages`."""
    return {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls") or ()}


def _add_item(out: list[dict[str, Any]], item: dict[str, Any], path: str,
              calls: dict[str, str]) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        out.append(_message(item, path))
    elif kind == "function_call":
        call = _function_call(item, path)
        calls[call["id"]] = call["function"]["name"]
        _join_call(out, call)
    elif kind == "function_call_output":
        out.append(_call_output(item, path, calls))
    elif kind != "reasoning":  # earlier reasoning is not shown to the model again
        raise ValidationError(
            f"`{path}.type` {kind!r} is not supported: input items are messages, "
            "function_call, function_call_output and reasoning")


ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def _message(item: dict[str, Any], path: str) -> dict[str, Any]:
    """A message item; `developer` is a system message (chat templates know no developer)."""
    role = req_str(item, "role", f"{path}.")
    if role not in ROLES:
        raise ValidationError(
            f"`{path}.role` must be \"user\", \"assistant\", \"system\" or \"developer\"")
    content = item.get("content")
    if not isinstance(content, str):
        content = _text_parts(content, f"{path}.content")
    return {"role": ROLES[role], "content": content}


# Content parts whose `text` is the text, as OpenAI names them in input and output.
TEXT_PARTS = ("input_text", "output_text", "text")


def _text_parts(value: Any, path: str) -> list[dict[str, Any]]:
    """Content parts as chat's: text parts and images by URL (chat reads the images)."""
    if not isinstance(value, list):
        raise wrong_type(path, "a string or an array of content parts", value)
    out: list[dict[str, Any]] = []
    for i, part in enumerate(value):
        part = obj(part, f"{path}[{i}]")
        kind, where = part.get("type"), f"{path}[{i}]."
        if kind in TEXT_PARTS:
            out.append({"type": "text", "text": req_str(part, "text", where)})
        elif kind == "refusal":
            out.append({"type": "text", "text": req_str(part, "refusal", where)})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            # `where`: the image's place in this body, for chat's image errors.
            out.append({"type": "image_url", "image_url": {"url": part["image_url"]},
                        "where": f"{path}[{i}]"})
        else:
            raise ValidationError(
                f"`{path}[{i}].type` {kind!r} is not supported: content parts are input_text, "
                "output_text, refusal and input_image with an `image_url`")
    return out


def _function_call(item: dict[str, Any], path: str) -> dict[str, Any]:
    where = f"{path}."
    return {"id": req_str(item, "call_id", where), "type": "function",
            "function": {"name": req_str(item, "name", where),
                         "arguments": req_str(item, "arguments", where)}}


def _join_call(out: list[dict[str, Any]], call: dict[str, Any]) -> None:
    """A call joins the assistant message just before it (its text, or calls made with it);
    otherwise it is an assistant message of its own."""
    last = out[-1] if out else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
        return
    out.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _call_output(item: dict[str, Any], path: str, calls: dict[str, str]) -> dict[str, Any]:
    call_id = req_str(item, "call_id", f"{path}.")
    if call_id not in calls:
        raise ValidationError(
            f"`{path}.call_id` {call_id!r}: no function_call with this call_id before it (in "
            "`input` or the response `previous_response_id` names)")
    output = item.get("output")
    if not isinstance(output, str):
        parts = _text_parts(output, f"{path}.output")
        output = "".join(p.get("text", "") for p in parts)
    return {"role": "tool", "tool_call_id": call_id, "name": calls[call_id], "content": output}


# ---- tools and format ----------------------------------------------------------------------------


def _chat_tool(value: Any, i: int) -> dict[str, Any]:
    """A Responses function tool (`name` at the top) as chat's `{type, function: {...}}`."""
    tool = obj(value, f"tools[{i}]")
    if tool.get("type") != "function":
        raise ValidationError(
            f"`tools[{i}].type` {tool.get('type')!r} is not supported: this server runs "
            "function tools only (type \"function\")")
    function: dict[str, Any] = {"name": req_str(tool, "name", f"tools[{i}].")}
    description = opt_str(tool, "description", f"tools[{i}].")
    if description is not None:
        function["description"] = description
    parameters = opt_obj(tool, "parameters", f"tools[{i}].")
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def offered_tools(tools: list[dict[str, Any]], choice: Any) -> tuple[list[dict[str, Any]], Any]:
    """The tools the chat request offers and its `tool_choice`: `allowed_tools` narrows the
    tools to those it names (the others stay declared, not offered) under its mode."""
    if not (isinstance(choice, dict) and choice.get("type") == "allowed_tools"):
        return tools, chat_tool_choice(choice)
    mode = choice.get("mode", "auto")
    if mode not in ("auto", "required"):
        raise ValidationError('`tool_choice.mode` must be "auto" or "required"')
    allowed = choice.get("tools")
    if not isinstance(allowed, list):
        raise wrong_type("tool_choice.tools", "an array of {type: function, name}", allowed)
    names = {req_str(obj(t, f"tool_choice.tools[{i}]"), "name", f"tool_choice.tools[{i}].")
             for i, t in enumerate(allowed)}
    unknown = sorted(names - {t["function"]["name"] for t in tools})
    if unknown:
        raise ToolError(f"Tool with name {unknown[0]} not found")
    return [t for t in tools if t["function"]["name"] in names], mode


def chat_tool_choice(value: Any) -> Any:
    """"auto" | "none" | "required" | `{type: "function", name}` in chat's spelling."""
    if value is None or value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": req_str(value, "name", "tool_choice.")}}
    raise ValidationError(
        '`tool_choice` must be "auto", "none", "required", {"type": "function", "name": ...} '
        'or {"type": "allowed_tools", ...} (hosted tools are not supported)')


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format`: text, json_object, or json_schema (its
    `schema` at the top, where chat nests it under `json_schema`); TGI's grammar objects
    (`{type: regex|json|lark, value}`) pass through, as chat's `response_format` lets them."""
    fmt = opt_obj(text, "format", "text.") if text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if "value" in fmt:
        return fmt
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = opt_obj(fmt, "schema", "text.format.")
        if schema is None:
            raise ValidationError("missing field `text.format.schema`")
        spec = {"name": fmt.get("name"), "schema": schema, "strict": fmt.get("strict")}
        return {"type": "json_schema", "json_schema": spec}
    raise ValidationError(
        '`text.format.type` must be "text", "json_object" or "json_schema" (or a TGI grammar '
        'object with its `value`)')
