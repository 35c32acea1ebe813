"""pytgi-router flags: TGI's names, their environment forms, the legacy alias, bad combinations."""

from __future__ import annotations

import dataclasses

import pytest

from pytgi_proto import contracts as c
from pytgi_router.cli import parse_settings


def test_flags_parse_into_settings() -> None:
    s = parse_settings([
        "--tokenizer-name", "/m", "--master-shard-address", "localhost:5000", "--port", "0",
        "--max-input-tokens", "100", "--max-total-tokens", "200", "--max-best-of", "3",
        "--cors-allow-origin", "http://a", "--cors-allow-origin", "http://b", "--api-key", "s3cr3t-KEY",
        "--json-output", "--waiting-served-ratio", "1.5", "--graceful-termination-timeout", "5",
    ], environ={})
    assert s.tokenizer_name == "/m" and s.served_model_id == "/m"
    assert s.shard_uri == "localhost:5000" and s.port == 0
    assert (s.max_input_tokens, s.max_total_tokens, s.max_best_of) == (100, 200, 3)
    assert s.cors_allow_origin == ("http://a", "http://b") and s.json_output
    assert s.waiting_served_ratio == 1.5 and s.graceful_termination_timeout == 5
    assert "s3cr3t-KEY" not in repr(s)  # the key never reaches logs through the settings


def test_defaults_are_tgi_defaults() -> None:
    s = parse_settings(["--tokenizer-name", "/m"], environ={})
    assert s.shard_uri == "unix:///tmp/text-generation-server-0"
    assert (s.max_concurrent_requests, s.max_best_of, s.max_stop_sequences, s.max_top_n_tokens,
            s.max_client_batch_size, s.payload_limit) == (128, 2, 4, 5, 4, 2_000_000)
    assert s.otlp_service_name == "pytgi.router" and s.graceful_termination_timeout == 90
    assert s.shard_step_timeout == 300
    assert s.max_connections == 1024
    assert s.drain_grace_seconds == 5
    # Left to the shards' Warmup (zero-config sizing), not TGI's 4096.
    assert s.max_batch_prefill_tokens is None and s.max_batch_total_tokens is None
    bounded = parse_settings(["--tokenizer-name", "/m", "--max-connections", "8"], environ={})
    assert bounded.max_connections == 8



def test_the_inference_core_gets_the_flags_it_takes() -> None:
    """RouterSettings → InferSettings → the scheduler's Budgets: each flag arrives unchanged."""
    from pytgi_router.core.capacity import ShardInfo
    from pytgi_router.core.step_plan import Budgets

    s = parse_settings([
        "--tokenizer-name", "/m", "--max-concurrent-requests", "9", "--max-batch-size", "3",
        "--waiting-served-ratio", "0.5", "--max-waiting-tokens", "7", "--max-queue-size", "4",
        "--max-batch-prefill-tokens", "300", "--shard-step-timeout", "2.5",
        "--prefix-caching", "false", "--max-decode-steps", "5",
    ], environ={})
    core = s.infer_settings()
    assert Budgets.of(core, ShardInfo("llama", "float32", "cpu", 16, 1, 99, 100, 1024, 200, 65,
                                      "paged", None)).max_decode_steps == 5
    assert core.prefix_caching is False
    assert (core.max_concurrent_requests, core.max_batch_size, core.max_queue_size) == (9, 3, 4)
    assert (core.max_batch_prefill_tokens, core.shard_step_timeout_s) == (300, 2.5)
    served = ShardInfo("llama", "float32", "cpu", 16, 1, 99, 100, 1024, 200, 65, "paged", None)
    budgets = Budgets.of(core, served)
    assert (budgets.max_batch_prefill_tokens, budgets.max_batch_total_tokens) == (200, 1024)
    assert (budgets.max_batch_size, budgets.waiting_served_ratio, budgets.max_waiting_tokens) == (
        3, 0.5, 7)
    defaults = parse_settings(["--tokenizer-name", "/m"], environ={}).infer_settings()
    assert defaults.prefix_caching is True
    assert Budgets.of(defaults, served) == Budgets(
        200, 1024, chunking=False, max_decode_steps=c.MAX_DECODE_STEPS,
        max_decode_call_ms=c.MAX_DECODE_CALL_MS)
    chunking = dataclasses.replace(served, support_chunking=True)
    assert Budgets.of(defaults, chunking).chunking


@pytest.mark.parametrize(("value", "expected"), [("0", False), ("false", False), ("true", True)])
def test_prefix_caching_from_the_environment(value: str, expected: bool) -> None:
    """TGI's PREFIX_CACHING; the command line wins."""
    s = parse_settings(["--tokenizer-name", "/m"], environ={"PREFIX_CACHING": value})
    assert s.prefix_caching is expected
    s = parse_settings(["--tokenizer-name", "/m", "--prefix-caching", str(not expected)],
                       environ={"PREFIX_CACHING": value})
    assert s.prefix_caching is (not expected)

def test_environment_forms_and_command_line_precedence() -> None:
    env = {"TOKENIZER_NAME": "/env", "MAX_BEST_OF": "4", "JSON_OUTPUT": "true", "PORT": "8081",
           "CORS_ALLOW_ORIGIN": "http://x,http://y", "MODEL_ID": "served", "HOSTNAME": "pod-7f9",
           "COMPUTE_TYPE": "1-cpu", "SHARD_STEP_TIMEOUT": "2.5"}
    s = parse_settings(["--max-best-of", "1"], environ=env)
    assert s.shard_step_timeout == 2.5
    assert s.tokenizer_name == "/env" and s.model_id == "served" and s.max_best_of == 1
    assert s.json_output and s.port == 8081 and s.cors_allow_origin == ("http://x", "http://y")
    # A container's HOSTNAME is its name, not an address: ignored as TGI does.
    assert s.hostname == "0.0.0.0" and s.compute_type == "1-cpu"
    assert parse_settings([], environ={**env, "HOSTNAME": "127.0.0.1"}).hostname == "127.0.0.1"


def test_legacy_input_length_alias() -> None:
    s = parse_settings(["--tokenizer-name", "/m", "--max-input-length", "50"], environ={})
    assert s.max_input_tokens == 50
    with pytest.raises(SystemExit):
        parse_settings(["--tokenizer-name", "/m", "--max-input-length", "50",
                        "--max-input-tokens", "60"], environ={})


@pytest.mark.parametrize("argv", [
    [],  # no tokenizer
    ["--tokenizer-name", "/m", "--max-input-tokens", "10", "--max-total-tokens", "10"],
    ["--tokenizer-name", "/m", "--max-total-tokens", "100", "--max-batch-total-tokens", "50"],
    ["--tokenizer-name", "/m", "--max-best-of", "0"],
    ["--tokenizer-name", "/m", "--port", "x"],
    ["--tokenizer-name", "/m", "--shard-step-timeout", "0"],
    ["--tokenizer-name", "/m", "--max-connections", "0"],
    ["--tokenizer-name", "/m", "--max-queue-size", "128"],
    ["--tokenizer-name", "/m", "--max-queue-size", "0"],
    ["--tokenizer-name", "/m", "--max-batch-prefill-tokens", "0"],  # refused, not measured
])
def test_bad_settings_exit_with_usage(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_settings(argv, environ={})
    assert info.value.code == 2
    assert "pytgi-router" in capsys.readouterr().err


def test_bad_environment_value_is_named() -> None:
    with pytest.raises(SystemExit):
        parse_settings(["--tokenizer-name", "/m"], environ={"MAX_BEST_OF": "many"})


def test_environment_booleans_and_blanks_read_as_the_launcher_reads_them() -> None:
    # The launcher hands its environment to the router: both parse it with the same rules.
    base = {"TOKENIZER_NAME": "/m"}
    assert parse_settings([], environ={**base, "JSON_OUTPUT": "off"}).json_output is False
    assert parse_settings([], environ={**base, "JSON_OUTPUT": "Yes"}).json_output is True
    assert parse_settings([], environ={**base, "PORT": "  "}).port == 3000
    with pytest.raises(SystemExit):
        parse_settings([], environ={**base, "JSON_OUTPUT": "maybe"})


def test_drain_grace_from_flag_or_environment() -> None:
    """--drain-grace-seconds (env DRAIN_GRACE_SECONDS): 0 restores the immediate drain; < 0 is
    refused with the flag's name."""
    assert parse_settings(["--tokenizer-name", "/m", "--drain-grace-seconds", "0"],
                          environ={}).drain_grace_seconds == 0
    assert parse_settings(["--tokenizer-name", "/m"],
                          environ={"DRAIN_GRACE_SECONDS": "12.5"}).drain_grace_seconds == 12.5
    with pytest.raises(SystemExit):
        parse_settings(["--tokenizer-name", "/m", "--drain-grace-seconds", "-1"], environ={})
