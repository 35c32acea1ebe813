"""vLLM's /tokenize body beside TGI's on the same route, the chat flags pytgi refuses, and the
sampling_params a render answer carries."""

from __future__ import annotations

import pytest

from pytgi_router.core.errors import ValidationError
from pytgi_router.http.openai.errors import owns
from pytgi_router.http.schemas import GenerateParameters
from pytgi_router.http.vllm_render import chat_flags, is_vllm_tokenize, sampling_params


def test_tokenize_bodies_are_told_apart() -> None:
    assert is_vllm_tokenize({"prompt": "a"}) and is_vllm_tokenize({"messages": []})
    assert not is_vllm_tokenize({"inputs": "a"}) and not is_vllm_tokenize(["a"])
    with pytest.raises(ValidationError, match="mixes TGI's `inputs`"):
        is_vllm_tokenize({"inputs": "a", "prompt": "a"})


def test_chat_flags_at_their_defaults_only() -> None:
    chat_flags({"add_generation_prompt": True, "continue_final_message": False})
    chat_flags({"add_generation_prompt": None})
    with pytest.raises(ValidationError, match="add_generation_prompt"):
        chat_flags({"add_generation_prompt": False})


def test_sampling_params_say_greedy_as_zero_temperature() -> None:
    greedy = sampling_params(GenerateParameters(temperature=0.7, max_new_tokens=5))
    assert greedy["temperature"] == 0.0 and greedy["max_tokens"] == 5
    sampled = sampling_params(GenerateParameters(temperature=0.7, do_sample=True, stop=["x"]))
    assert sampled["temperature"] == 0.7 and sampled["stop"] == ["x"]


def test_render_routes_answer_errors_in_openai_shape() -> None:
    assert owns("/v1/chat/completions/render") and owns("/detokenize")
    assert not owns("/tokenize") and not owns("/v1/chat/completions")
