"""errors.py: router errors in OpenAI's shape, `param` named as the Responses API names it."""

from __future__ import annotations

import json

from pytgi_router.core.errors import GenerationError, OverloadedError, ValidationError
from pytgi_router.http.http_errors import PayloadTooLargeError
from pytgi_router.http.openai.errors import ResponseNotFound, error_bytes, openai_error, owns


def test_shape_type_param_and_code() -> None:
    err = openai_error(ValidationError("`inputs` tokens + `max_new_tokens` must be <= 256"))
    assert err == {"error": {"message": err["error"]["message"], "type": "invalid_request_error",
                             "param": "input", "code": "validation"}}
    assert openai_error(ValidationError("`input[2].role` must be"))["error"]["param"] == (
        "input[2].role")
    assert openai_error(OverloadedError())["error"]["type"] == "rate_limit_error"
    failed = openai_error(GenerationError("`x` broke"))["error"]
    assert (failed["type"], failed["param"], failed["code"]) == ("server_error", None,
                                                                 "generation")
    missing = openai_error(ResponseNotFound("resp_1", "previous_response_id"))["error"]
    assert (missing["type"], missing["param"]) == ("not_found_error", "previous_response_id")
    assert "resp_1" in missing["message"] and "replica" in missing["message"]


def test_the_guard_answers_the_responses_routes_in_this_shape() -> None:
    assert owns("/v1/responses") and owns("/v1/responses/resp_1/cancel")
    assert not owns("/v1/responses_x") and not owns("/v1/chat/completions")
    status, body = error_bytes(PayloadTooLargeError(10))
    assert status == 413 and json.loads(body)["error"]["type"] == "invalid_request_error"
