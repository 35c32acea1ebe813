"""`pytgi-router`: TGI's router flags (each also read from its FOO_BAR environment variable)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from pytgi_proto.cli_env import env_values, parse_bool, resolve_input_length_alias
from pytgi_proto.version import add_version_flag
from pytgi_router.http.media.flags import ALLOW_MEDIA_URLS_HELP, MEDIA_FLAGS
from pytgi_router.http.reasoning.registry import NO_PARSER, PARSER_NAMES
from pytgi_router.settings import DEFAULT_MASTER_SHARD_UDS_PATH, RouterSettings

log = logging.getLogger("pytgi.router")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pytgi-router",
        description="pytgi HTTP router: TGI's HTTP API in front of pytgi shards.",
        argument_default=argparse.SUPPRESS,
    )
    add = p.add_argument
    add("--master-shard-uds-path", help=f"rank 0's unix socket (default {DEFAULT_MASTER_SHARD_UDS_PATH})")
    add("--master-shard-address", help="rank 0's host:port (TCP); wins over the socket path")
    add("--shard-token", help="the shards' shared secret, sent with every call (env SHARD_TOKEN, "
        "preferred: argv is visible to every user)")
    add("--tokenizer-name", help="model directory (or cached Hub id) holding tokenizer.json")
    add("--tokenizer-config-path", help="alternate tokenizer_config.json (e.g. a chat_template)")
    add("--model-id", help="the model's id in /info (default: --tokenizer-name)")
    add("--served-model-name", help="the name in /v1/models and OpenAI responses' `model` "
        "(default: --model-id)")
    add("--revision", help="Hub revision of the tokenizer")
    add("--hostname", help="bind address (default 0.0.0.0)")
    add("-p", "--port", type=int, help="HTTP port (default 3000; 0 picks a free one)")
    for flag, kind, default in _LIMITS:
        shown = _default(flag) if default is None else default
        add(flag, type=kind, help=f"(default {shown})")
    add("--max-input-length", type=int, help="legacy alias of --max-input-tokens")
    only = ("only for shards that do not support chunking (a prefill then pauses the running "
            "batch; shards that chunk mix newcomers into every step): ")
    add("--waiting-served-ratio", type=float,
        help=f"(default {_default('--waiting-served-ratio')}) {only}waiting requests join a running "
             "batch when they are at least this many per running request")
    add("--max-waiting-tokens", type=int,
        help=f"(default {_default('--max-waiting-tokens')}) {only}or once they waited this many "
             "decode steps")
    add("--max-decode-steps", type=int,
        help=f"(default {_default('--max-decode-steps')}) decode steps one shard call may run "
             "back to back while nothing waits to join (no queue, no prompt chunk, blocks for "
             "every step): the router's turn and the gRPC round trip are paid once per that many "
             "tokens; a request arriving meanwhile cuts the call short; 1: one step per call")
    add("--max-decode-call-ms", type=int,
        help=f"(default {_default('--max-decode-call-ms')}) the longest a multi-step call is "
             "planned to run: its steps are as many as fit at the last call's time per step, "
             "bounding a stream's token bursts and the tokens computed past a cancel; 0: no bound")
    add("--prefix-caching", type=parse_bool, metavar="{true,false}",
        help="reuse the KV of prompt prefixes already computed (default true; env "
             "PREFIX_CACHING)")
    add("--api-key", help="require `Authorization: Bearer <key>` (or `x-api-key: <key>` on "
                          "Anthropic's /v1/messages)")
    add("--cors-allow-origin", action="append", help="allowed CORS origin (repeatable)")
    add("--otlp-endpoint", help="OTLP gRPC collector, e.g. http://localhost:4317")
    add("--otlp-service-name", help="service.name of the traces (default pytgi.router)")
    add("--json-output", action="store_true", help="JSON log lines")
    add("--disable-grammar-support", action="store_true", help="reject `grammar`")
    add("--reasoning-parser", choices=(*PARSER_NAMES, NO_PARSER),
        help="split the model's thinking from its answer (`reasoning_content`), vLLM's names; "
             f"`{NO_PARSER}`: never (default: detected from the chat template where it is "
             "unambiguous, else none)")
    add("--responses-store-bytes", type=int,
        help="memory for stored /v1/responses (GET by id, previous_response_id), in bytes of "
             "JSON, per replica; least recently used out first; 0 stores none (default "
             f"{_default('--responses-store-bytes')})")
    for flag, kind, text in MEDIA_FLAGS:
        add(flag, type=kind, help=text)
    add("--allow-media-urls", action="store_true", help=ALLOW_MEDIA_URLS_HELP)
    add("-g", "--graceful-termination-timeout", type=float,
        help=f"drain seconds (default {_default('--graceful-termination-timeout'):g})")
    add("--drain-grace-seconds", type=float,
        help="after SIGTERM, seconds /health answers 503 while requests are still admitted, so "
             "that load balancers stop sending before admission stops; then the drain "
             f"(default {_default('--drain-grace-seconds'):g})")
    add("--shard-step-timeout", type=float,
        help="seconds one Prefill/Decode may take before its batch fails with 424 and the router "
             f"reconnects to the shards (default {_default('--shard-step-timeout'):g})")
    # Accepted for TGI compatibility (launchers pass them); they change nothing here.
    for flag in ("--prometheus-port", "--usage-stats"):
        add(flag, help=argparse.SUPPRESS)
    add("--trust-remote-code", action="store_true", help=argparse.SUPPRESS)
    add_version_flag(p)
    return p


# (flag, type, what its help says the default is; None: RouterSettings' own default).
_LIMITS: list[tuple[str, type, str | None]] = [
    ("--max-concurrent-requests", int, None),
    ("--max-best-of", int, None),
    ("--max-stop-sequences", int, None),
    ("--max-top-n-tokens", int, None),
    ("--max-input-tokens", int, "from the shard's warmup"),
    ("--max-total-tokens", int, "from the shard's warmup"),
    ("--max-batch-prefill-tokens", int, "measured by the shards at warmup"),
    ("--max-batch-total-tokens", int, "from the shard's warmup"),
    ("--max-batch-size", int, None),
    ("--max-queue-size", int, "none: waiting requests hold permits"),
    ("--max-client-batch-size", int, None),
    ("--payload-limit", int, None),
    ("--max-connections", int, None),
    ("--validation-workers", int, None),
    ("--max-grammar-bytes", int, None),
]


def _default(flag: str) -> Any:
    """RouterSettings' default for `flag`: the help text never restates a number."""
    fields = {f.name: f.default for f in dataclasses.fields(RouterSettings)}
    return fields[flag.lstrip("-").replace("-", "_")]


_IGNORED = ("prometheus_port", "usage_stats", "trust_remote_code")


def parse_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> RouterSettings:
    """Command line > environment > defaults, into one RouterSettings (exits 2 on bad input)."""
    environ = os.environ if environ is None else environ
    parser = _parser()
    values = env_values(parser, environ, skip=("version",))
    cli = vars(parser.parse_args(argv))
    values.update(cli)
    resolve_input_length_alias(parser, values, cli)
    for key in _IGNORED:
        values.pop(key, None)
    if "allowed_media_domains" in values:
        values["allowed_media_domains"] = tuple(values["allowed_media_domains"])
    if "cors_allow_origin" in values:
        values["cors_allow_origin"] = tuple(values["cors_allow_origin"])
    compute_type = environ.get("COMPUTE_TYPE")
    if compute_type:
        values["compute_type"] = compute_type
    values.setdefault("tokenizer_name", environ.get("MODEL_ID", ""))
    try:
        return RouterSettings(**values)
    except ValueError as err:
        parser.error(str(err))
        raise  # unreachable: parser.error exits


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(argv)
    # Imported here: parsing flags (and --help) need none of the server's dependencies.
    from pytgi_router.server import configure_logging, run

    configure_logging(settings.json_output)

    try:
        return run(settings)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
