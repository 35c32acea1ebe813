"""The Responses API's share of the OpenAPI document (/docs): its request body, the response
object and OpenAI's error shape, and its four routes. Kept beside the routes it describes; the
document (http/openapi.py) merges it."""

from __future__ import annotations

from typing import Any

RESPONSE = "#/components/schemas/Response"
OPENAI_ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/OpenAIError"}}}

CONTENT_PARTS = {"type": "array", "items": {"type": "object", "description":
                 "{type: input_text|output_text, text} or {type: input_image, image_url}"}}
INPUT_ITEM = {"type": "object", "description": (
    "a message {role: user|assistant|system|developer, content: string or parts}, "
    "{type: function_call, call_id, name, arguments}, {type: function_call_output, call_id, "
    "output} or {type: reasoning} (not shown to the model again)"),
    "properties": {"type": {"type": "string"}, "role": {"type": "string"},
                   "content": {"oneOf": [{"type": "string"}, CONTENT_PARTS]}}}

SCHEMAS: dict[str, Any] = {
    "ResponsesRequest": {"type": "object", "required": ["input"], "properties": {
        "model": {"type": "string"},
        "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": INPUT_ITEM}]},
        "instructions": {"type": "string", "nullable": True,
                         "description": "a system message first (not carried to follow-ups)"},
        "previous_response_id": {"type": "string", "nullable": True, "description":
                                 "continue a response stored by this replica"},
        "store": {"type": "boolean", "default": True, "description":
                  "keep the response for GET and previous_response_id (this replica's memory, "
                  "--responses-store-bytes)"},
        "stream": {"type": "boolean", "default": False},
        "max_output_tokens": {"type": "integer", "nullable": True},
        "temperature": {"type": "number", "nullable": True},
        "top_p": {"type": "number", "nullable": True},
        "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name"],
                  "properties": {"type": {"type": "string", "enum": ["function"]},
                                 "name": {"type": "string"}, "description": {"type": "string"},
                                 "parameters": {"type": "object"}}}},
        "tool_choice": {"description": '"auto", "none", "required", {type: function, name} '
                        'or {type: allowed_tools, mode, tools}',
                        "oneOf": [{"type": "string"}, {"type": "object"}]},
        "text": {"type": "object", "description": "{format: {type: text|json_object} or "
                 "{type: json_schema, name, schema, strict}} (pytgi: or a TGI grammar object "
                 "{type: regex|json, value})"},
        "seed": {"type": "integer", "nullable": True, "description": "pytgi's extension"},
        "tool_prompt": {"type": "string", "nullable": True,
                        "description": "pytgi's extension: chat's tool prompt"},
        "chat_template_kwargs": {"type": "object", "nullable": True, "description":
                                 "pytgi's extension: the chat template's variables "
                                 "(e.g. enable_thinking)"},
        "background": {"type": "boolean", "default": False, "description":
                       "run in this replica's background: poll GET /v1/responses/{id}; "
                       "cancel with POST .../cancel"},
    }},
    "Response": {"type": "object", "description": (
        "OpenAI `response`: id, status (completed|incomplete|failed), output items (message, "
        "function_call, reasoning), usage; streamed as `response.*` events")},
    "OpenAIError": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": "string", "nullable": True},
            "code": {"type": "string", "nullable": True}}}}},
}

ERRORS = {str(code): {"description": text, "content": OPENAI_ERROR} for code, text in [
    (400, "Malformed body, or a response that cannot be cancelled"),
    (404, "No such response on this replica"), (422, "Input validation error"),
    (424, "Generation error"), (429, "Model is overloaded")]}


def _answer(summary: str, stream: bool = False) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": {"$ref": RESPONSE}}}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    return {"summary": summary, "responses": {"200": {"description": "OK", "content": content},
                                              **ERRORS}}


PATHS: dict[str, Any] = {
    "/v1/responses": {"post": {
        **_answer("OpenAI Responses API: create a response (SSE with `stream`)", stream=True),
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/ResponsesRequest"}}}}}},
    "/v1/responses/{response_id}": {
        "parameters": [{"name": "response_id", "in": "path", "required": True,
                        "schema": {"type": "string"}}],
        "get": _answer("A stored response"),
        "delete": {"summary": "Delete a stored response",
                   "responses": {"200": {"description": "{id, object: response.deleted, "
                                                        "deleted: true}"}, **ERRORS}}},
    "/v1/responses/{response_id}/input_items": {
        "parameters": [{"name": "response_id", "in": "path", "required": True,
                        "schema": {"type": "string"}},
                       {"name": "order", "in": "query", "schema": {"type": "string",
                                                                   "enum": ["asc", "desc"]}},
                       {"name": "limit", "in": "query", "schema": {"type": "integer"}},
                       {"name": "after", "in": "query", "schema": {"type": "string"}}],
        "get": {"summary": "A stored response's input items", "responses": {
            "200": {"description": "{object: list, data, first_id, last_id, has_more}"},
            **ERRORS}}},
    "/v1/responses/{response_id}/cancel": {
        "parameters": [{"name": "response_id", "in": "path", "required": True,
                        "schema": {"type": "string"}}],
        "post": _answer("Cancel a background response")},
}
