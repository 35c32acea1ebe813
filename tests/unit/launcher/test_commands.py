"""The children's command lines, parsed by the children's own parsers: no flag drift possible."""

from __future__ import annotations

from pathlib import Path

from pytgi_launcher.cli import parse_settings
from pytgi_launcher.commands import router_argv, router_env, shard_argv, shard_env
from pytgi_router.cli import parse_settings as parse_router
from pytgi_shard.service.cli import build_parser as shard_parser
from pytgi_shard.service.cli import settings_from_args as shard_settings

MODEL = Path("/models/tiny")


def test_shard_command_is_understood_by_the_shard() -> None:
    s = parse_settings(["--shard-uds-path", "/run/s", "--master-addr", "10.0.0.1",
                        "--master-port", "29600", "--cuda-memory-fraction", "0.5",
                        "--json-output", "--otlp-endpoint", "http://c:4317",
                        "--watermark-gamma", "0.4", "--step-timeline", "/tmp/t.jsonl",
                        "--kv-cache-dtype", "fp8_e5m2", "--speculate", "3"],
                       environ={"SPECULATOR_MODEL": "/models/draft"})
    argv = shard_argv(s, MODEL, rank=1, world_size=2, dtype="float32")
    assert argv[1:3] == ["-m", "pytgi_shard.service.cli"]
    env = shard_env(s, {"LOG_LEVEL": "debug", "KEEP": "1"}, rank=1, world_size=2)
    shard = shard_settings(shard_parser().parse_args(argv[3:]), env)
    assert shard.model_path == MODEL and (shard.rank, shard.world_size) == (1, 2)
    assert (shard.master_addr, shard.master_port) == ("10.0.0.1", 29600)
    assert shard.listen_address == "unix:///run/s-1"
    assert shard.dtype == "float32" and shard.cuda_memory_fraction == 0.5
    assert shard.json_output and shard.otlp_endpoint == "http://c:4317"
    assert shard.watermark_gamma == 0.4
    assert shard.step_timeline == Path("/tmp/t.jsonl")
    assert shard.kv_cache_dtype == "fp8_e5m2"
    assert shard.speculate == 3 and shard.speculator_model == Path("/models/draft")
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2" and env["KEEP"] == "1"
    assert "LOG_LEVEL" not in env


def test_router_command_is_understood_by_the_router() -> None:
    s = parse_settings(["--model-id", "org/model", "--port", "8080", "--hostname", "127.0.0.1",
                        "--max-input-tokens", "100", "--max-total-tokens", "200",
                        "--max-batch-prefill-tokens", "300", "--max-batch-total-tokens", "4000",
                        "--max-batch-size", "8", "--max-concurrent-requests", "9",
                        "--max-best-of", "3", "--max-stop-sequences", "5", "--max-top-n-tokens", "6",
                        "--waiting-served-ratio", "1.2", "--max-waiting-tokens", "7",
                        "--max-client-batch-size", "2", "--payload-limit", "1234",
                        "--max-connections", "77",
                        "--cors-allow-origin", "http://a", "--cors-allow-origin", "http://b",
                        "--api-key", "k", "--disable-grammar-support", "--json-output",
                        "--otlp-service-name", "svc", "--graceful-termination-timeout", "5",
                        "--prefix-caching", "false", "--drain-grace-seconds", "2.5"],
                       environ={})
    argv = router_argv(s, MODEL)
    env = router_env(s, {}, "2-cpu")
    assert "k" not in argv, "the API key must not be visible in the process list"
    r = parse_router(argv[3:], environ=env)
    assert r.shard_uri == "unix:///tmp/text-generation-server-8080-0"
    assert r.tokenizer_name == str(MODEL) and r.served_model_id == "org/model"
    assert (r.hostname, r.port) == ("127.0.0.1", 8080)
    assert (r.max_input_tokens, r.max_total_tokens) == (100, 200)
    assert (r.max_batch_prefill_tokens, r.max_batch_total_tokens, r.max_batch_size) == (300, 4000, 8)
    assert (r.max_concurrent_requests, r.max_best_of, r.max_stop_sequences) == (9, 3, 5)
    assert (r.max_top_n_tokens, r.waiting_served_ratio, r.max_waiting_tokens) == (6, 1.2, 7)
    assert (r.max_client_batch_size, r.payload_limit, r.max_connections) == (2, 1234, 77)
    assert r.cors_allow_origin == ("http://a", "http://b") and r.api_key == "k"
    assert r.disable_grammar_support and r.json_output and r.otlp_service_name == "svc"
    assert r.graceful_termination_timeout == 5 and r.compute_type == "2-cpu"
    assert r.drain_grace_seconds == 2.5
    assert r.prefix_caching is False
    # On by default, and TGI's PREFIX_CACHING=0 turns it off through the launcher too.
    assert parse_router(router_argv(parse_settings([], environ={}), MODEL)[3:],
                        environ={}).prefix_caching
    off = parse_settings([], environ={"PREFIX_CACHING": "0"})
    assert parse_router(router_argv(off, MODEL)[3:], environ={}).prefix_caching is False


def test_the_reasoning_parser_reaches_the_router() -> None:
    """--reasoning-parser (or REASONING_PARSER) goes to the router as given; unset, the router
    detects one from the chat template."""
    s = parse_settings(["--reasoning-parser", "deepseek_r1"], environ={})
    assert parse_router(router_argv(s, MODEL)[3:], environ={}).reasoning_parser == "deepseek_r1"
    off = parse_settings([], environ={"REASONING_PARSER": "none"})
    assert parse_router(router_argv(off, MODEL)[3:], environ={}).reasoning_parser == "none"
    assert "--reasoning-parser" not in router_argv(parse_settings([], environ={}), MODEL)


def test_unset_limits_are_left_to_the_router() -> None:
    argv = router_argv(parse_settings([], environ={}), MODEL)
    for flag in ("--max-input-tokens", "--max-total-tokens", "--max-batch-total-tokens",
                 "--max-batch-prefill-tokens", "--api-key"):
        assert flag not in argv


def test_user_compute_type_wins() -> None:
    s = parse_settings([], environ={})
    assert router_env(s, {"COMPUTE_TYPE": "mine"}, "1-cpu")["COMPUTE_TYPE"] == "mine"


def test_the_shard_token_reaches_shards_and_router_through_the_environment() -> None:
    """--shard-token (or SHARD_TOKEN) goes to every child's environment, never its argv."""
    s = parse_settings(["--shard-token", "t0k", "--port", "8080"], environ={})
    argv = shard_argv(s, MODEL, rank=0, world_size=1, dtype="float32", master_port=29999,
                      instance_id="abc")
    env = shard_env(s, {}, rank=0, world_size=1, master_port=29999)
    assert "t0k" not in argv and env["SHARD_TOKEN"] == "t0k"
    shard = shard_settings(shard_parser().parse_args(argv[3:]), env)
    assert shard.shard_token == "t0k" and shard.instance_id == "abc"
    assert shard.master_port == 29999 and shard.socket_path == "/tmp/text-generation-server-8080-0"
    rargv = router_argv(s, MODEL)
    renv = router_env(s, {}, "1-cpu")
    assert "t0k" not in rargv
    assert parse_router(rargv[3:], environ=renv).shard_token == "t0k"
