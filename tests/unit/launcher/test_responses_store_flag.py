"""--responses-store-bytes travels from the launcher to the router (flag or environment), and a
negative value is refused by both."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytgi_launcher.cli import parse_settings
from pytgi_launcher.commands import router_argv
from pytgi_proto.contracts import RESPONSES_STORE_BYTES
from pytgi_router.cli import parse_settings as parse_router

MODEL = Path("/models/tiny")


def router_store_bytes(argv: list[str], environ: dict[str, str]) -> int:
    s = parse_settings(["--model-id", str(MODEL), *argv], environ=environ)
    return parse_router(router_argv(s, MODEL)[3:], environ={}).responses_store_bytes


def test_default_flag_and_environment_reach_the_router() -> None:
    assert router_store_bytes([], {}) == RESPONSES_STORE_BYTES
    assert router_store_bytes(["--responses-store-bytes", "0"], {}) == 0
    assert router_store_bytes([], {"RESPONSES_STORE_BYTES": "1234"}) == 1234


def test_a_negative_budget_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        parse_settings(["--model-id", "m", "--responses-store-bytes", "-1"], environ={})
    with pytest.raises(SystemExit):
        parse_router(["--tokenizer-name", "m", "--responses-store-bytes", "-1"], environ={})
