"""Parsing and validation of the load tool's settings."""

from __future__ import annotations

import math
import random

import pytest

from pytgi_bench.settings import LengthRange, LoadSettings, parse_slo


def test_length_range_fixed_and_uniform() -> None:
    fixed = LengthRange.parse("32")
    assert fixed.fixed and str(fixed) == "32"
    assert {fixed.sample(random.Random(s)) for s in range(20)} == {32}
    span = LengthRange.parse("16:20")
    draws = {span.sample(random.Random(s)) for s in range(200)}
    assert draws == {16, 17, 18, 19}


@pytest.mark.parametrize("text", ["0", "x", "5:5", "9:3", "-1:4", "3:"])
def test_length_range_rejects_bad_text(text: str) -> None:
    with pytest.raises(ValueError, match="length"):
        LengthRange.parse(text)


def test_parse_slo() -> None:
    assert parse_slo(["ttft:500", "tpot:50", "e2el:2000.5"]) == {
        "ttft": 500.0,
        "tpot": 50.0,
        "e2el": 2000.5,
    }
    for bad in (["itl:5"], ["ttft"], ["ttft:fast"], ["tpot:0"]):
        with pytest.raises(ValueError, match="goodput SLO"):
            parse_slo(bad)


def test_settings_validation_messages() -> None:
    assert LoadSettings(url="http://h:1/").url == "http://h:1"
    with pytest.raises(ValueError, match="--api"):
        LoadSettings(url="http://h:1", api="grpc")
    with pytest.raises(ValueError, match="--url"):
        LoadSettings(url="h:1")
    with pytest.raises(ValueError, match="--duration needs"):
        LoadSettings(url="http://h:1", duration_s=5.0, request_rate=math.inf)
    with pytest.raises(ValueError, match="--request-rate"):
        LoadSettings(url="http://h:1", request_rate=0.0)
