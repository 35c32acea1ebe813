"""--lora-adapters (and its env form LORA_ADAPTERS) reaches the shards' settings unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytgi_launcher.cli import parse_settings
from pytgi_launcher.commands import shard_argv, shard_env
from pytgi_shard.service.cli import build_parser as shard_parser
from pytgi_shard.service.cli import settings_from_args as shard_settings

SPEC = "sql=/adapters/sql,org/chat-lora"


@pytest.mark.parametrize(("argv", "environ"), [
    (["--lora-adapters", SPEC], {}),
    ([], {"LORA_ADAPTERS": SPEC}),
])
def test_the_adapters_reach_the_shard(argv: list[str], environ: dict[str, str]) -> None:
    s = parse_settings(argv, environ=environ)
    command = shard_argv(s, Path("/models/tiny"), rank=0, world_size=1, dtype="float32")
    shard = shard_settings(shard_parser().parse_args(command[3:]), shard_env(s, {}, 0, 1))
    assert shard.lora_adapters == SPEC


def test_without_the_flag_the_shard_loads_none() -> None:
    s = parse_settings([], environ={})
    command = shard_argv(s, Path("/models/tiny"), rank=0, world_size=1, dtype="float32")
    assert "--lora-adapters" not in command
    assert shard_settings(shard_parser().parse_args(command[3:]), {}).lora_adapters is None


@pytest.mark.parametrize(("argv", "environ"), [
    (["--enable-lora-runtime-updates", "--max-loras", "3", "--max-lora-rank", "16"], {}),
    ([], {"ENABLE_LORA_RUNTIME_UPDATES": "true", "MAX_LORAS": "3", "MAX_LORA_RANK": "16"}),
])
def test_live_loading_and_the_slots_reach_the_shard(argv: list[str],
                                                    environ: dict[str, str]) -> None:
    s = parse_settings(argv, environ=environ)
    command = shard_argv(s, Path("/models/tiny"), rank=0, world_size=1, dtype="float32")
    shard = shard_settings(shard_parser().parse_args(command[3:]), shard_env(s, {}, 0, 1))
    assert (shard.lora_runtime_updates, shard.max_loras, shard.max_lora_rank) == (True, 3, 16)


def test_by_default_no_live_loading_and_the_shard_sizes_the_slots() -> None:
    s = parse_settings([], environ={})
    command = shard_argv(s, Path("/models/tiny"), rank=0, world_size=1, dtype="float32")
    shard = shard_settings(shard_parser().parse_args(command[3:]), {})
    assert (shard.lora_runtime_updates, shard.max_loras, shard.max_lora_rank) == (
        False, None, None)
    assert shard.max_cpu_loras is None


@pytest.mark.parametrize(("argv", "environ"), [
    (["--max-cpu-loras", "5"], {}),
    ([], {"MAX_CPU_LORAS": "5"}),
])
def test_the_host_cap_reaches_the_shard(argv: list[str], environ: dict[str, str]) -> None:
    s = parse_settings(argv, environ=environ)
    command = shard_argv(s, Path("/models/tiny"), rank=0, world_size=1, dtype="float32")
    shard = shard_settings(shard_parser().parse_args(command[3:]), shard_env(s, {}, 0, 1))
    assert shard.max_cpu_loras == 5
