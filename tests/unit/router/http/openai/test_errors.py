"""errors.py: router errors in OpenAI's shape, `param` named as the Responses API names it."""

from __future__ import annotations

from pytgi_router.core.errors import GenerationError, OverloadedError, ValidationError
from pytgi_router.http.openai.errors import ResponseNotFound, openai_error


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
