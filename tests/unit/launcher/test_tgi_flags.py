"""TGI's launcher flags pytgi used to refuse (issue "Hardening II", item 13): --rope-scaling /
--rope-factor, --disable-custom-kernels, --served-model-name, --enable-prefill-logprobs and
--version / -V; their environment forms, their validation, and what reaches the children (parsed
back by the children's own parsers, so the two sides cannot drift)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pytgi_launcher.cli import main as launcher_main
from pytgi_launcher.cli import parse_settings
from pytgi_launcher.commands import router_argv, shard_argv, shard_env
from pytgi_proto.version import package_version, version_line
from pytgi_router.cli import main as router_main
from pytgi_router.cli import parse_settings as parse_router
from pytgi_shard.service.cli import build_parser as shard_parser
from pytgi_shard.service.cli import main as shard_main
from pytgi_shard.service.cli import settings_from_args as shard_settings
from pytgi_shard.settings import ShardSettings

MODEL = Path("/models/tiny")


def shard_of(argv: list[str], environ: dict[str, str] | None = None) -> ShardSettings:
    """The ShardSettings rank 0 builds from what the launcher gives it."""
    s = parse_settings(argv, environ=environ or {})
    child = shard_argv(s, MODEL, rank=0, world_size=1, dtype="float32")
    env = shard_env(s, environ or {}, rank=0, world_size=1)
    return shard_settings(shard_parser().parse_args(child[3:]), env)


def test_flags_reach_the_shards() -> None:
    shard = shard_of(["--rope-scaling", "dynamic", "--rope-factor", "4",
                      "--disable-custom-kernels"])
    assert (shard.rope_scaling, shard.rope_factor) == ("dynamic", 4.0)
    assert shard.rope_scaling_override == {"rope_type": "dynamic", "type": "dynamic",
                                           "factor": 4.0}
    assert shard.disable_custom_kernels


def test_tgi_environment_forms() -> None:
    env = {"ROPE_SCALING": "linear", "ROPE_FACTOR": "2.5", "DISABLE_CUSTOM_KERNELS": "true",
           "SERVED_MODEL_NAME": "my-model", "ENABLE_PREFILL_LOGPROBS": "true"}
    s = parse_settings([], environ=env)
    assert (s.rope_scaling, s.rope_factor, s.disable_custom_kernels) == ("linear", 2.5, True)
    assert s.served_model_name == "my-model"
    assert shard_of([], env).rope_scaling_override == {"rope_type": "linear", "type": "linear",
                                                       "factor": 2.5}


def test_defaults_change_nothing() -> None:
    s = parse_settings([], environ={})
    assert s.rope_scaling is None and s.rope_factor is None
    assert not s.disable_custom_kernels and s.served_model_name is None
    argv = shard_argv(s, MODEL, rank=0, world_size=1, dtype="float32")
    for flag in ("--rope-scaling", "--rope-factor", "--disable-custom-kernels"):
        assert flag not in argv
    assert "--served-model-name" not in router_argv(s, MODEL)
    shard = shard_of([])
    assert shard.rope_scaling_override is None and not shard.disable_custom_kernels


@pytest.mark.parametrize(
    ("scaling", "factor", "expected"),
    [
        # TGI: the kind alone scales by 1.0; the factor alone is linear.
        ("dynamic", None, {"rope_type": "dynamic", "type": "dynamic", "factor": 1.0}),
        (None, 3.0, {"rope_type": "linear", "type": "linear", "factor": 3.0}),
        ("linear", 8.0, {"rope_type": "linear", "type": "linear", "factor": 8.0}),
    ],
)
def test_rope_pair_is_read_as_tgi_reads_it(
    scaling: str | None, factor: float | None, expected: dict[str, object]
) -> None:
    argv = [*(["--rope-scaling", scaling] if scaling else []),
            *(["--rope-factor", str(factor)] if factor else [])]
    assert shard_of(argv).rope_scaling_override == expected


def test_served_model_name_reaches_the_router_and_not_info() -> None:
    s = parse_settings(["--model-id", "org/model", "--served-model-name", "gpt-4o-mini"],
                       environ={})
    r = parse_router(router_argv(s, MODEL)[3:], environ={})
    assert r.openai_model_name == "gpt-4o-mini"
    assert r.served_model_id == "org/model", "/info keeps the model's id, as TGI"
    plain = parse_router(router_argv(parse_settings(["--model-id", "org/model"], environ={}),
                                     MODEL)[3:], environ={})
    assert plain.openai_model_name == "org/model"


def test_prefill_logprobs_switch_is_accepted_in_both_forms() -> None:
    """pytgi always serves prompt logprobs; TGI deployments pass the switch (or its variable)."""
    assert parse_settings(["--enable-prefill-logprobs"], environ={}) == parse_settings(
        [], environ={})
    assert parse_settings([], environ={"ENABLE_PREFILL_LOGPROBS": "false"}) == parse_settings(
        [], environ={})


def test_shard_refuses_bad_rope_environment() -> None:
    """A shard started alone (TGI's variables, no launcher) explains instead of guessing."""
    args = shard_parser().parse_args(["serve", str(MODEL)])
    with pytest.raises(ValueError, match="--rope-scaling must be one of linear, dynamic"):
        shard_settings(args, {"ROPE_SCALING": "su"})
    with pytest.raises(ValueError, match="ROPE_FACTOR='x' is not a valid float"):
        shard_settings(args, {"ROPE_FACTOR": "x"})
    with pytest.raises(ValueError, match="DISABLE_CUSTOM_KERNELS"):
        shard_settings(args, {"DISABLE_CUSTOM_KERNELS": "maybe"})
    # TGI's launcher writes DISABLE_CUSTOM_KERNELS=True.
    assert shard_settings(args, {"DISABLE_CUSTOM_KERNELS": "True"}).disable_custom_kernels


@pytest.mark.parametrize("entry", [launcher_main, router_main, shard_main])
@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_prints_one_line_and_exits_0(
    entry: object, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert callable(entry)
    with pytest.raises(SystemExit) as exc:
        entry([flag])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"pytgi {package_version()}\n"


def test_version_wins_over_missing_arguments_and_ignores_a_version_variable() -> None:
    """`pytgi-shard -V` needs no subcommand; containers often export VERSION, which is no flag."""
    assert parse_settings([], environ={"VERSION": "1.2.3"}).model_id
    assert parse_router(["--tokenizer-name", "/m"], environ={"VERSION": "1"}).tokenizer_name
    out = subprocess.run([sys.executable, "-m", "pytgi_launcher.cli", "-V"], capture_output=True,
                         text=True, timeout=60, check=False)
    assert (out.returncode, out.stdout) == (0, version_line() + "\n")
    assert version_line() == f"pytgi {package_version()}" and package_version() != "0.0.0"
