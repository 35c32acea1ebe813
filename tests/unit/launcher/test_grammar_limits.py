"""The grammar limits travel from the launcher to the process that applies them: the router's
--max-grammar-bytes (the longest grammar it compiles) and the shards' --grammar-cache-bytes
(what their grammar cache holds), each also read from its environment variable, each refused
when not positive."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytgi_launcher.cli import parse_settings
from pytgi_launcher.commands import router_argv, shard_argv, shard_env
from pytgi_proto.contracts import MAX_GRAMMAR_BYTES
from pytgi_router.cli import parse_settings as parse_router
from pytgi_shard.service.cli import build_parser as shard_parser
from pytgi_shard.service.cli import settings_from_args as shard_settings
from pytgi_shard.settings import DEFAULT_GRAMMAR_CACHE_BYTES

MODEL = Path("/models/tiny")


def children(argv: list[str], environ: dict[str, str]) -> tuple[int, int]:
    """(the router's max_grammar_bytes, rank 0's grammar_cache_bytes) as they parse them."""
    s = parse_settings(argv, environ=environ)
    router = parse_router(router_argv(s, MODEL)[3:], environ={})
    shard_args = shard_parser().parse_args(shard_argv(s, MODEL, 0, 1, "float32")[3:])
    shard = shard_settings(shard_args, shard_env(s, {}, 0, 1))
    return router.max_grammar_bytes, shard.grammar_cache_bytes


def test_defaults_flags_and_environment_reach_the_children() -> None:
    assert children([], {}) == (MAX_GRAMMAR_BYTES, DEFAULT_GRAMMAR_CACHE_BYTES)
    flags = ["--max-grammar-bytes", "1000", "--grammar-cache-bytes", "2000"]
    assert children(flags, {}) == (1000, 2000)
    env = {"MAX_GRAMMAR_BYTES": "3000", "GRAMMAR_CACHE_BYTES": "4000"}
    assert children([], env) == (3000, 4000)


def test_the_children_read_their_own_environment_too() -> None:
    assert parse_router(["--tokenizer-name", "m"], {"MAX_GRAMMAR_BYTES": "5"}).max_grammar_bytes == 5
    args = shard_parser().parse_args(["serve", "/m"])
    assert shard_settings(args, {"GRAMMAR_CACHE_BYTES": "6"}).grammar_cache_bytes == 6


@pytest.mark.parametrize("flag", ["--max-grammar-bytes", "--grammar-cache-bytes"])
def test_a_limit_must_be_positive(flag: str) -> None:
    with pytest.raises(SystemExit):
        parse_settings([flag, "0"], environ={})
