"""pytgi-launcher's flags: TGI's names, their environment forms, defaults and validation."""

from __future__ import annotations

import pytest

from pytgi_launcher.cli import build_parser, main, parse_settings
from pytgi_launcher.settings import DEMO_MODEL, LauncherSettings
from pytgi_proto.cli_env import env_name


def test_defaults_are_tgis_except_the_model() -> None:
    s = parse_settings([], environ={})
    assert s.model_id == str(DEMO_MODEL)
    assert (s.port, s.hostname, s.shard_base_path) == (3000, "0.0.0.0", "/tmp/text-generation-server")
    # No fixed rendezvous port (a second instance would collide): launch picks a free one.
    assert (s.master_addr, s.master_port) == ("localhost", None)
    assert (s.max_concurrent_requests, s.max_best_of, s.max_stop_sequences) == (128, 2, 4)
    assert (s.max_top_n_tokens, s.max_client_batch_size, s.payload_limit) == (5, 4, 2_000_000)
    assert (s.waiting_served_ratio, s.max_waiting_tokens) == (0.3, 20)
    assert s.max_input_tokens is None and s.max_total_tokens is None
    assert s.num_shard is None and s.sharded is None and s.dtype is None
    assert s.max_shard_restarts == 3
    assert not s.json_output and not s.trust_remote_code


def test_default_socket_is_derived_from_the_http_port() -> None:
    """One instance per HTTP port is already the rule, so sockets derived from it never collide;
    TGI's port keeps TGI's path (its tools look for /tmp/text-generation-server-0)."""
    assert parse_settings([], environ={}).shard_socket(0) == "/tmp/text-generation-server-0"
    other = parse_settings(["--port", "8080"], environ={})
    assert other.shard_socket(1) == "/tmp/text-generation-server-8080-1"
    given = parse_settings(["--port", "8080", "--shard-uds-path", "/run/s"], environ={})
    assert given.shard_socket(0) == "/run/s-0"


def test_every_flag_has_its_environment_form() -> None:
    env = {
        "MODEL_ID": "/models/x", "REVISION": "v2", "NUM_SHARD": "2", "SHARDED": "true",
        "DTYPE": "bfloat16", "PORT": "8080", "MAX_TOTAL_TOKENS": "512", "MAX_INPUT_TOKENS": "100",
        "MAX_BATCH_PREFILL_TOKENS": "300", "WAITING_SERVED_RATIO": "1.5", "JSON_OUTPUT": "1",
        "TRUST_REMOTE_CODE": "true", "CORS_ALLOW_ORIGIN": "http://a, http://b",
        "API_KEY": "secret", "HUGGINGFACE_HUB_CACHE": "/cache", "OTLP_ENDPOINT": "http://c:4317",
        "SHARD_UDS_PATH": "/run/pytgi", "MASTER_PORT": "29600", "CUDA_MEMORY_FRACTION": "0.5",
        "MAX_CLIENT_BATCH_SIZE": "8", "PAYLOAD_LIMIT": "1000", "DISABLE_GRAMMAR_SUPPORT": "yes",
        "MAX_SHARD_RESTARTS": "0",
    }
    s = parse_settings([], environ=env)
    assert s.model_id == "/models/x" and s.revision == "v2"
    assert s.num_shard == 2 and s.sharded is True and s.dtype == "bfloat16"
    assert s.port == 8080 and s.max_total_tokens == 512 and s.max_input_tokens == 100
    assert s.max_batch_prefill_tokens == 300 and s.waiting_served_ratio == 1.5
    assert s.json_output and s.trust_remote_code and s.disable_grammar_support
    assert s.cors_allow_origin == ("http://a", "http://b")
    assert s.api_key == "secret" and s.huggingface_hub_cache == "/cache"
    assert s.otlp_endpoint == "http://c:4317" and s.shard_uds_path == "/run/pytgi"
    assert s.master_port == 29600 and s.cuda_memory_fraction == 0.5
    assert s.max_client_batch_size == 8 and s.payload_limit == 1000
    assert s.max_shard_restarts == 0


def test_every_long_flag_maps_to_an_upper_snake_variable() -> None:
    flags = [max(a.option_strings, key=len) for a in build_parser()._actions if a.option_strings]
    assert env_name("--max-batch-total-tokens") == "MAX_BATCH_TOTAL_TOKENS"
    for flag in flags:
        assert env_name(flag) == flag[2:].upper().replace("-", "_")


def test_command_line_wins_over_environment() -> None:
    s = parse_settings(["--port", "9000", "--num-shard", "1", "--json-output"],
                       environ={"PORT": "8080", "NUM_SHARD": "4", "JSON_OUTPUT": "false"})
    assert (s.port, s.num_shard, s.json_output) == (9000, 1, True)


def test_container_hostname_is_not_a_bind_address() -> None:
    assert parse_settings([], environ={"HOSTNAME": "pytgi-7d9f"}).hostname == "0.0.0.0"
    assert parse_settings([], environ={"HOSTNAME": "127.0.0.1"}).hostname == "127.0.0.1"
    assert parse_settings([], environ={"HOSTNAME": "::"}).hostname == "::"


def test_env_flag_has_no_environment_form() -> None:
    assert parse_settings([], environ={"ENV": "1"}).env is False
    assert parse_settings(["--env"], environ={}).env is True


def test_legacy_max_input_length() -> None:
    assert parse_settings(["--max-input-length", "7"], environ={}).max_input_tokens == 7
    assert parse_settings([], environ={"MAX_INPUT_LENGTH": "9"}).max_input_tokens == 9


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--max-input-tokens", "5", "--max-input-length", "6"], {}, "aliases"),
        (["--max-input-tokens", "10", "--max-total-tokens", "10"], {}, "must be < --max-total"),
        (["--max-total-tokens", "10", "--max-batch-total-tokens", "5"], {}, "must be <="),
        (["--dtype", "float64"], {}, "invalid choice"),
        (["--num-shard", "0"], {}, "--num-shard must be >= 1"),
        (["--sharded", "true", "--num-shard", "1"], {}, "needs --num-shard > 1"),
        (["--sharded", "maybe"], {}, "expected true or false"),
        (["--port", "70000"], {}, "--port must be in 1..65535"),
        (["--cuda-memory-fraction", "0"], {}, "--cuda-memory-fraction"),
        (["--payload-limit", "0"], {}, "--payload-limit must be > 0"),
        (["--max-shard-restarts", "-1"], {}, "--max-shard-restarts must be >= 0"),
        ([], {"NUM_SHARD": "two"}, "NUM_SHARD='two' is not valid for --num-shard"),
        ([], {"DTYPE": "int8"}, "DTYPE='int8' is not valid"),
        ([], {"JSON_OUTPUT": "perhaps"}, "JSON_OUTPUT='perhaps'"),
        # TGI's flags pytgi took later (tests/unit/launcher/test_tgi_flags.py).
        (["--rope-scaling", "yarn"], {}, "invalid choice: 'yarn'"),
        ([], {"ROPE_SCALING": "ntk"}, "ROPE_SCALING='ntk' is not valid for --rope-scaling"),
        (["--rope-factor", "0"], {}, "--rope-factor must be a positive number, got 0.0"),
        (["--rope-factor", "nan"], {}, "--rope-factor must be a positive number"),
        ([], {"ROPE_FACTOR": "two"}, "ROPE_FACTOR='two' is not valid for --rope-factor"),
        (["--attention", "triton", "--disable-custom-kernels"], {},
         "--attention triton contradicts --disable-custom-kernels"),
        (["--served-model-name", " "], {}, "--served-model-name must not be empty"),
        ([], {"DISABLE_CUSTOM_KERNELS": "sometimes"}, "DISABLE_CUSTOM_KERNELS='sometimes'"),
        (["--kv-cache-dtype", "fp8"], {}, "invalid choice: 'fp8'"),
        ([], {"KV_CACHE_DTYPE": "int8"}, "KV_CACHE_DTYPE='int8' is not valid for --kv-cache-dtype"),
        (["--speculate", "-1"], {}, "--speculate must be in 0..16, got -1"),
        ([], {"SPECULATE": "17"}, "--speculate must be in 0..16, got 17"),
        (["--speculator-model", "/models/draft"], {}, "give --speculate N (1..16)"),
    ],
)
def test_bad_input_is_a_usage_error(
    argv: list[str], env: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_settings(argv, environ=env)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


# TGI's find_num_shards table (reference/tgi.md 1.8).
@pytest.mark.parametrize(
    ("sharded", "num_shard", "gpus", "expected"),
    [
        (None, None, 0, 1), (None, None, 4, 4), (None, 3, 0, 3), (None, 2, 8, 2),
        (True, None, 2, 2), (True, 4, 0, 4), (False, None, 8, 1), (False, 3, 8, 3),
    ],
)
def test_num_shards(sharded: bool | None, num_shard: int | None, gpus: int, expected: int) -> None:
    assert LauncherSettings(sharded=sharded, num_shard=num_shard).num_shards(gpus) == expected


def test_sharded_without_enough_gpus_is_an_error() -> None:
    with pytest.raises(ValueError, match="needs more than one visible GPU"):
        LauncherSettings(sharded=True).num_shards(1)


def test_dtype_defaults_by_device() -> None:
    assert LauncherSettings().resolved_dtype(on_gpu=True) == "bfloat16"
    assert LauncherSettings().resolved_dtype(on_gpu=False) == "float32"
    assert LauncherSettings(dtype="float16").resolved_dtype(on_gpu=False) == "float16"


def test_env_report(capsys: pytest.CaptureFixture[str]) -> None:
    import torch
    import transformers

    assert main(["--env"]) == 0
    out = capsys.readouterr().out
    # The distribution's version: "2.11.0" for the wheel whose torch.__version__ is "2.11.0+cu130".
    for needle in ("Python", "Platform", "CPU", torch.__version__.split("+")[0],
                   transformers.__version__,
                   "CUDA available", "nvidia-smi"):
        assert needle in out
