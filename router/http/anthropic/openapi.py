"""The Anthropic routes in the OpenAPI document (/docs): their bodies, answers and error shape,
which http/openapi.py adds to TGI's and OpenAI's."""

from __future__ import annotations

from typing import Any


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        out["required"] = required
    return out


def _enum(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


STRING, INTEGER, NUMBER = {"type": "string"}, {"type": "integer"}, {"type": "number"}
TEXT_BLOCK = _obj({"type": _enum("text"), "text": STRING}, ["type", "text"])
CONTENT_BLOCK = _obj({
    "type": _enum("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"),
    "text": STRING, "source": {"type": "object", "description": "image: {type: base64, "
                                                                  "media_type, data} or {type: url, url}"},
    "id": STRING, "name": STRING, "input": {"type": "object"},
    "tool_use_id": STRING, "is_error": {"type": "boolean"},
    "content": {"oneOf": [STRING, {"type": "array", "items": TEXT_BLOCK}]},
}, ["type"])
STOP_REASON = _enum("end_turn", "max_tokens", "stop_sequence", "tool_use")
# Fields of both bodies: the conversation and what the prompt renders from.
CONVERSATION: dict[str, Any] = {
    "model": {"type": "string", "description": "echoed in the answer; any name is served"},
    "messages": {"type": "array", "items": _obj({
        "role": _enum("user", "assistant"),
        "content": {"oneOf": [STRING, {"type": "array", "items": CONTENT_BLOCK}]},
    }, ["role", "content"])},
    "system": {"oneOf": [STRING, {"type": "array", "items": TEXT_BLOCK}]},
    "tools": {"type": "array", "items": _obj({
        "name": STRING, "description": STRING, "input_schema": {"type": "object"},
        "type": _enum("custom"),
    }, ["name", "input_schema"])},
    "tool_choice": _obj({"type": _enum("auto", "any", "tool", "none"), "name": STRING,
                         "disable_parallel_tool_use": {"type": "boolean"}}, ["type"]),
    "thinking": _obj({"type": _enum("enabled", "disabled", "adaptive"),
                      "budget_tokens": INTEGER}, ["type"]),
    "tool_prompt": {"type": "string", "description": "TGI's extension: the text appended to "
                                                     "the last message with the tools"},
}

SCHEMAS: dict[str, Any] = {
    "MessagesRequest": _obj({
        **CONVERSATION,
        "max_tokens": {"type": "integer", "minimum": 1},
        "stop_sequences": {"type": "array", "items": STRING},
        "stream": {"type": "boolean", "default": False},
        "temperature": NUMBER, "top_p": NUMBER, "top_k": INTEGER,
        "seed": {"type": "integer", "description": "TGI's extension"},
        "metadata": _obj({"user_id": STRING}),
        "output_config": _obj({"format": _obj({"type": _enum("json_schema"),
                                               "schema": {"type": "object"}},
                                              ["type", "schema"])}),
    }, ["model", "max_tokens", "messages"]),
    "CountTokensRequest": _obj(CONVERSATION, ["model", "messages"]),
    "Message": _obj({
        "id": STRING, "type": _enum("message"), "role": _enum("assistant"), "model": STRING,
        "content": {"type": "array", "items": CONTENT_BLOCK},
        "stop_reason": STOP_REASON, "stop_sequence": {"type": "string", "nullable": True},
        "usage": _obj({"input_tokens": INTEGER, "output_tokens": INTEGER},
                      ["input_tokens", "output_tokens"]),
    }, ["id", "type", "role", "model", "content", "stop_reason", "usage"]),
    "MessageTokensCount": _obj({"input_tokens": INTEGER}, ["input_tokens"]),
    "AnthropicError": _obj({
        "type": _enum("error"),
        "error": _obj({"type": STRING, "message": STRING}, ["type", "message"]),
    }, ["type", "error"]),
}

ERRORS = {
    str(code): {"description": f"{kind}", "content": {
        "application/json": {"schema": _ref("AnthropicError")}}}
    for code, kind in [(400, "invalid_request_error (TGI's 400 and 422)"),
                       (401, "authentication_error"), (404, "not_found_error"),
                       (413, "request_too_large"), (500, "api_error"),
                       (529, "overloaded_error (TGI's 429)")]
}
STREAM = ("with `stream: true`, server-sent events with `event:` lines: message_start, "
          "content_block_start, content_block_delta (text_delta, input_json_delta, "
          "thinking_delta), content_block_stop, message_delta, message_stop; error")


def _post(summary: str, request: str, response: str, stream: bool) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": _ref(response)}}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string", "description": STREAM}}
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {"200": {"description": "OK", "content": content}, **ERRORS},
    }}


PATHS: dict[str, Any] = {
    "/v1/messages": _post("Anthropic Messages", "MessagesRequest", "Message", stream=True),
    "/v1/messages/count_tokens": _post(
        "Anthropic token count of a Messages body", "CountTokensRequest", "MessageTokensCount",
        stream=False),
}
