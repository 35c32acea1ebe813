"""SGLang's /generate body beside TGI's: which shape a body is, and what its sampling_params
mean as TGI's parameters (the body sglang-router forwards, flags and nulls included)."""

from __future__ import annotations

import pytest

from pytgi_router.core.errors import ValidationError
from pytgi_router.http.sglang_generate import is_sglang, parse_sglang

# What sglang-router 0.3.2 sent for `{"text": ..., "sampling_params": {...}}` (captured).
FORWARDED = {
    "text": "Hello", "model": None, "sampling_params": {"temperature": 0.0, "max_new_tokens": 3},
    "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
    "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
    "return_entropy": False,
}


def test_shapes_are_told_apart() -> None:
    assert is_sglang(FORWARDED)
    assert is_sglang({"input_ids": [1, 2]})
    assert not is_sglang({"inputs": "Hello", "parameters": {}})
    assert not is_sglang(["not", "an", "object"])
    with pytest.raises(ValidationError, match="mixes TGI's `inputs`"):
        is_sglang({"inputs": "a", "text": "b"})


def test_the_forwarded_body_is_greedy_with_its_limit() -> None:
    req = parse_sglang(FORWARDED)
    assert req.inputs == "Hello" and req.stream is False
    p = req.parameters
    assert p.max_new_tokens == 3 and not p.do_sample and p.details


def test_token_ids_are_kept_as_given() -> None:
    req = parse_sglang({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
    assert req.input_ids == [5, 6, 7] and req.inputs == ""


def test_lora_path_names_the_adapter() -> None:
    """SGLang's `lora_path` is the adapter's name, as TGI's adapter_id (then validated against
    the loaded adapters like any adapter_id); null runs the base model."""
    assert parse_sglang({"text": "x", "lora_path": "sql"}).parameters.adapter_id == "sql"
    assert parse_sglang({"text": "x", "lora_path": None}).parameters.adapter_id is None


def test_sampling_defaults_and_mapping() -> None:
    """SGLang samples at temperature 1 by default, 128 new tokens; its "off" values vanish."""
    p = parse_sglang({"text": "x"}).parameters
    assert p.do_sample and p.max_new_tokens == 128 and p.temperature is None
    p = parse_sglang({"text": "x", "stream": True, "sampling_params": {
        "temperature": 0.5, "top_p": 1.0, "top_k": -1, "stop": ["\n"], "sampling_seed": 7,
        "regex": "[ab]+"}}).parameters
    assert p.do_sample and p.temperature == 0.5 and p.top_p is None and p.top_k is None
    assert p.stop == ["\n"] and p.seed == 7


@pytest.mark.parametrize(("body", "message"), [
    ({"text": "a", "input_ids": [1]}, "one of `text` and `input_ids`"),
    ({"input_ids": [[1], [2]]}, "one list of token ids"),
    ({"text": ["a", "b"]}, "one string"),
    ({"text": "x", "return_logprob": True}, "`return_logprob` is not supported"),
    ({"text": "x", "foo": 1}, "unknown field `foo`"),
    ({"text": "x", "sampling_params": {"n": 2}}, "sampling_params.n"),
    ({"text": "x", "sampling_params": {"bar": 1}}, "unknown field `sampling_params.bar`"),
    ({"text": "x", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "x", "stream": "yes"}, "`stream` must be a boolean"),
    ({"text": "x", "lora_path": ["a", "b"]}, "`lora_path` must be one adapter name"),
])
def test_bad_bodies_are_clear_422s(body: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        parse_sglang(body)
