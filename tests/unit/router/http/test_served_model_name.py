"""--served-model-name: the name OpenAI clients see in /v1/models and in chat and completions'
`model`; /info keeps the model's id, as TGI's /info does."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from pytgi_proto import generate_pb2
from pytgi_router.cli import parse_settings
from pytgi_router.core.capacity import derive_info
from pytgi_router.core.infer_settings import InferSettings
from pytgi_router.core.lora_adapters import AdapterTable
from pytgi_router.http.routes_info import InfoRoutes
from pytgi_router.http.state import AppState
from pytgi_router.settings import RouterSettings

INFO = generate_pb2.InfoResponse(dtype="float32", device_type="cpu", attention_impl="reference",
                                 block_size=16, model_type="llama", world_size=1)
WARMUP = generate_pb2.WarmupResponse(max_supported_total_tokens=1024, max_input_tokens=255,
                                     max_total_tokens=256, num_blocks=65, block_size=16)


def state_of(settings: RouterSettings) -> AppState:
    info = derive_info(InferSettings(max_batch_prefill_tokens=512), INFO, WARMUP, 1)
    # /info and /v1/models read the settings, the shards' info and the adapters, nothing else.
    fake: Any = None
    infer = SimpleNamespace(info=info, adapters=AdapterTable(info.lora_adapters))
    return AppState(settings=settings, infer=infer,  # type: ignore[arg-type]
                    info=info, validator=fake, metrics=fake, chat_template=None)


def models_json(state: AppState) -> dict[str, Any]:
    no_request: Any = None  # the route reads nothing from its request
    response = asyncio.run(InfoRoutes(state).models(no_request))
    return dict(json.loads(bytes(response.body)))


def test_served_name_in_models_and_openai_but_not_info() -> None:
    s = parse_settings(["--tokenizer-name", "/models/x", "--model-id", "org/model",
                        "--served-model-name", "my-model"], environ={})
    state = state_of(s)
    assert state.info_json()["model_id"] == "org/model"
    assert state.model_id == "my-model", "chat and completions answer with state.model_id"
    assert models_json(state)["data"][0]["id"] == "my-model"


def test_without_it_everything_names_the_model_id() -> None:
    state = state_of(parse_settings(["--tokenizer-name", "/models/x", "--model-id", "org/model"],
                                    environ={}))
    assert state.info_json()["model_id"] == state.model_id == "org/model"
    assert models_json(state)["data"][0]["id"] == "org/model"


def test_environment_form_and_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    s = parse_settings(["--tokenizer-name", "/m"], environ={"SERVED_MODEL_NAME": "env-name"})
    assert s.openai_model_name == "env-name" and s.served_model_id == "/m"
    with pytest.raises(SystemExit) as exc:
        parse_settings(["--tokenizer-name", "/m", "--served-model-name", ""], environ={})
    assert exc.value.code == 2
    assert "--served-model-name must not be empty" in capsys.readouterr().err
