"""The worker routes' share of the OpenAPI document (/docs): what SGLang's router
(routes_workers.py, sglang_generate.py) and vLLM's router (vllm_render.py) call on a replica,
in their field names. Kept beside the routes it describes; the document (http/openapi.py)
merges it."""

from __future__ import annotations

from typing import Any

ERRORS = {code: {"description": text, "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for code, text in [("400", "Refused (flush with requests in flight)"),
                       ("401", "Bad API key")]}
OPENAI_ERRORS = {code: {"description": text, "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/OpenAIError"}}}}
    for code, text in [("401", "Bad API key"), ("422", "Input validation error"),
                       ("429", "Model is overloaded")]}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _get(summary: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"summary": summary, "responses": {
        "200": {"description": "OK", "content": {"application/json": {"schema": schema}}},
        **ERRORS}}


def _post(summary: str, request: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
        "responses": {"200": {"description": "OK",
                              "content": {"application/json": {"schema": response}}},
                      **OPENAI_ERRORS}}}


SCHEMAS: dict[str, Any] = {
    "ModelInfo": {"type": "object", "description": "SGLang's model fields: model_path, "
                  "served_model_name, tokenizer_path, is_generation, model_type, architectures, "
                  "weight_version"},
    "ServerInfo": {"type": "object", "description": "ModelInfo and SGLang's server fields: "
                   "tp_size, dp_size, max_total_num_tokens, max_prefill_tokens, context_length, "
                   "max_running_requests, page_size, version"},
    "Load": {"type": "array", "items": {"type": "object", "properties": {
        "dp_rank": {"type": "integer"}, "num_reqs": {"type": "integer"},
        "num_waiting_reqs": {"type": "integer"}, "num_tokens": {"type": "integer"}}}},
    "SglangGenerateRequest": {"type": "object", "description": "SGLang's body (`text` or "
                              "`input_ids`, no `inputs`)", "properties": {
        "text": {"type": "string"}, "input_ids": {"type": "array", "items": {"type": "integer"}},
        "sampling_params": {"type": "object"}, "stream": {"type": "boolean"},
        "lora_path": {"type": "string", "nullable": True,
                      "description": "a loaded LoRA adapter's name (TGI's adapter_id)"}}},
    "VllmGenerateRequest": {"type": "object", "description": "vLLM's GenerateRequest: the "
                            "request rendered to the token ids it would run", "properties": {
        "request_id": {"type": "string"},
        "token_ids": {"type": "array", "items": {"type": "integer"}},
        "sampling_params": {"type": "object"}, "model": {"type": "string"},
        "stream": {"type": "boolean"}}},
    "VllmTokenizeRequest": {"type": "object", "description": "vLLM's body: `prompt` or "
                            "`messages` (a chat, templated), no `inputs`", "properties": {
        "model": {"type": "string"}, "prompt": {"type": "string"},
        "messages": {"type": "array", "items": {"type": "object"}},
        "add_special_tokens": {"type": "boolean"}, "return_token_strs": {"type": "boolean"}}},
    "VllmTokenizeResponse": {"type": "object", "properties": {
        "count": {"type": "integer"}, "max_model_len": {"type": "integer"},
        "tokens": {"type": "array", "items": {"type": "integer"}},
        "token_strs": {"type": "array", "items": {"type": "string"}, "nullable": True}}},
}

PATHS: dict[str, Any] = {
    **{path: {"get": _get("Model and server fields (SGLang's router)", _ref("ServerInfo"))}
       for path in ("/server_info", "/get_server_info")},
    **{path: {"get": _get("Model fields (SGLang's router)", _ref("ModelInfo"))}
       for path in ("/model_info", "/get_model_info")},
    "/get_load": {"get": _get("Requests and KV tokens in use (SGLang's router)", _ref("Load"))},
    "/flush_cache": {method: _get("Forget the cached prefixes (400 with requests in flight)",
                                  {"type": "string"}) for method in ("get", "post")},
    "/v1/chat/completions/render": _post(
        "A chat rendered to the token ids it would run (vLLM's router)", _ref("ChatRequest"),
        _ref("VllmGenerateRequest")),
    "/v1/completions/render": _post(
        "Completions prompts rendered to token ids, one request each (vLLM's router)",
        _ref("CompletionRequest"), {"type": "array", "items": _ref("VllmGenerateRequest")}),
    "/detokenize": _post("Token ids to text (vLLM's shape)", {"type": "object", "properties": {
        "tokens": {"type": "array", "items": {"type": "integer"}}}, "required": ["tokens"]},
        {"type": "object", "properties": {"prompt": {"type": "string"}}}),
}
