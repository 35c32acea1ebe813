"""What every pytgi process must agree on beyond generate.proto, defined once.

The launcher passes flags to the shards and the router and relays their log lines; a default
that differed between two of them (a socket path, a scheduler ratio) or a log line the launcher
could not parse would be a bug between processes. Every process already imports this package, so
these live here: the import graph stays launcher → {shard, router} → proto, never sideways.
"""

from __future__ import annotations

import json
import logging
import time

# --dtype names, as TGI's.
DTYPES = ("float16", "bfloat16", "float32")

# TGI's socket base name: shard r listens on `{base}-{r}`, so TGI's own tools find rank 0.
DEFAULT_UDS_PATH = "/tmp/text-generation-server"
TGI_HTTP_PORT = 3000


def shard_socket(base: str, rank: int) -> str:
    """The unix socket rank `rank` listens on for the base name `base`."""
    return f"{base}-{rank}"


# Request limits and scheduler budgets: TGI's defaults, shared by the launcher's, the router's
# and the inference core's settings.
MAX_CONCURRENT_REQUESTS = 128
MAX_BEST_OF = 2
MAX_STOP_SEQUENCES = 4
MAX_TOP_N_TOKENS = 5
MAX_CLIENT_BATCH_SIZE = 4
PAYLOAD_LIMIT = 2_000_000
# The longest grammar (compact JSON Schema or regex) the router compiles: router/http/grammar.py
# says why compiling more costs more than the output is worth.
MAX_GRAMMAR_BYTES = 65_536
# Whitespace between JSON tokens in constrained output: at most one space, as TGI's
# outlines-built grammars allow (a model cannot loop on blank lines inside an object). The
# shards compile JSON Schemas with it; the router sets it on the schemas it embeds in a Lark
# grammar (a reasoning model's answer), so both constrain JSON alike.
JSON_WHITESPACE = r"[ ]?"
# The memory (bytes of JSON) the router keeps stored /v1/responses objects and their
# conversations in, for GET by id and `previous_response_id`; least recently used out first.
RESPONSES_STORE_BYTES = 64 * 1024 * 1024
MAX_BATCH_PREFILL_TOKENS = 4096
WAITING_SERVED_RATIO = 0.3
MAX_WAITING_TOKENS = 20
# Decode steps one Decode call may run when nothing waits to join (multi-step decode;
# router/core/decode_steps.py); 1 turns it off. A newcomer cuts a call short (CutShort), so k
# does not cost its TTFT; what k still costs (a stream's tokens arrive in bursts of a call, a
# cancelled request computes to the call's end, blocks are granted ahead for every step) grows
# with the call's duration, which MAX_DECODE_CALL_MS bounds. 32: with compiled steps the demo
# model's single stream on this 2-core CPU decodes at 421-440 tok/s against 327-390 for 8
# (2.2 ms steps, a call's round trip ~2.5 ms; bench/results/cpu/decode_steps_k.json).
MAX_DECODE_STEPS = 32
# The longest a multi-step call is planned to run: its steps are as many as fit at the last
# call's time per step, so a stream's bursts stay under ~this whatever the model's step time
# (the demo model's batch of 64 at ~30 ms a step: 3 steps; a single stream at 2.2 ms: 32).
MAX_DECODE_CALL_MS = 100
# The most steps a shard runs in one Decode call (a bound on one call's duration, far past where
# another step still pays); the router's flag is checked against it.
DECODE_STEPS_LIMIT = 64


def token_limit_problems(
    max_input_tokens: int | None, max_total_tokens: int | None, max_batch_total_tokens: int | None
) -> list[str]:
    """How the token limits that are set must relate; the launcher checks them before it spawns
    anything, the router again on its own flags."""
    out = []
    if (
        max_input_tokens is not None
        and max_total_tokens is not None
        and max_input_tokens >= max_total_tokens
    ):
        out.append(
            f"--max-input-tokens ({max_input_tokens}) must be < --max-total-tokens "
            f"({max_total_tokens})"
        )
    if (
        max_total_tokens is not None
        and max_batch_total_tokens is not None
        and max_total_tokens > max_batch_total_tokens
    ):
        out.append(
            f"--max-total-tokens ({max_total_tokens}) must be <= "
            f"--max-batch-total-tokens ({max_batch_total_tokens})"
        )
    return out


def utc_timestamp(created: float) -> str:
    """A log line's timestamp: UTC with milliseconds, as TGI's JSON logs."""
    millis = int(created % 1 * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{millis:03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per log line (timestamp, level, target, message): the shape the router and
    the shards print and the launcher relays, adding the process name."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "timestamp": utc_timestamp(record.created),
            "level": record.levelname,
            "target": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)
