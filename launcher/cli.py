"""`pytgi-launcher`: TGI's launcher flags, each also read from its FOO_BAR environment variable.

The command line wins over the environment, the environment over the defaults. `--env` has no
environment form (as in TGI). The environment is read here and nowhere else.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from pytgi_launcher.settings import DEMO_MODEL, LauncherSettings
from pytgi_proto.cli_env import env_values, parse_bool, resolve_input_length_alias
from pytgi_proto.contracts import DEFAULT_UDS_PATH, DTYPES, MAX_DECODE_CALL_MS, MAX_DECODE_STEPS
from pytgi_proto.version import add_version_flag
from pytgi_router.http.media.flags import ALLOW_MEDIA_URLS_HELP, MEDIA_FLAGS
from pytgi_router.http.reasoning.registry import NO_PARSER, PARSER_NAMES
from pytgi_shard.quantization.method import parse_quantize
from pytgi_shard.settings import KV_CACHE_DTYPES, ROPE_SCALINGS

# (flag, type, help); the default shown is LauncherSettings'.
_VALUED: list[tuple[str, Any, str]] = [
    ("--model-id", str, f"local directory or Hub repo id (default: the bundled demo, {DEMO_MODEL})"),
    ("--revision", str, "Hub revision (branch, tag or commit)"),
    ("--served-model-name", str, "the model's name in /v1/models and OpenAI responses' `model` "
     "(default: --model-id; /info keeps --model-id)"),
    ("--num-shard", int, "number of shards (default: visible GPUs, 1 on CPU)"),
    ("--dtype", str, f"one of {', '.join(DTYPES)} (default: bfloat16 on GPU, float32 on CPU)"),
    ("--quantize", parse_quantize, "quantize a float checkpoint on load: bitsandbytes, "
     "bitsandbytes-nf4, bitsandbytes-fp4, eetq, fp8; pre-quantized gptq, awq, fp8 and "
     "compressed-tensors checkpoints are detected without it (marlin: gptq)"),
    ("--kv-cache-dtype", str, "store the shards' KV cache in FP8: fp8_e4m3fn or fp8_e5m2, "
     "with the checkpoint's per-layer k_scale/v_scale (1.0 without them); about 2x the "
     "tokens of a bfloat16 cache (default: the model's dtype)"),
    ("--speculate", int, "draft up to N tokens per sequence and step by n-gram (prompt) lookup, "
     "verified by the model in one forward: greedy rows give exactly the tokens they give without "
     "it; only batches of at most 2 sequences draft, and sampling, penalised, watermarked and "
     "grammar rows never do (0..16; default 0: off)"),
    ("--speculator-model", str, "drafts for --speculate N in place of n-gram lookup: a draft "
     "model's directory (a model of the registry with the model's tokenizer, e.g. a smaller one "
     "of its family; its own KV cache takes its share of the KV memory) or speculator heads "
     "detected as TGI does (Medusa: medusa_num_heads; IBM's MLP speculator: its architecture "
     "in config.json; CUDA graphs off), or an EAGLE-3 head for a Llama-style model "
     "(architecture LlamaForCausalLMEagle3 / Eagle3LlamaForCausalLM; CUDA graphs off)"),
    ("--lora-adapters", str, "LoRA adapters to serve, selected per request by `adapter_id` (or "
     "OpenAI's `model`): a comma list of `id`, `name=id` or `name=path` (PEFT adapter "
     "directories or Hub ids); pytgi's Llama-family models with float weights"),
    ("--max-loras", int, "LoRA adapters on the device at once (one step never mixes more); "
     "past it the least recently used idle adapter is evicted to host memory and copied back "
     "when asked for (default: the --lora-adapters count; with runtime updates at least 4)"),
    ("--max-cpu-loras", int, "LoRA adapters kept in host memory, those on the device included "
     "(>= --max-loras; vLLM's flag); past it the least recently used idle one off the device is "
     "dropped and re-read from its path when next used (default: every loaded adapter is kept)"),
    ("--max-lora-rank", int, "largest LoRA rank accepted, 1..64; the device slots are sized for "
     "it (default 64 with runtime updates, else the --lora-adapters' largest)"),
    ("--rope-scaling", str, "replace the model's RoPE scaling: linear or dynamic (factor 1.0 "
     "unless --rope-factor)"),
    ("--rope-factor", float, "RoPE scaling factor (alone: linear scaling)"),
    ("--max-concurrent-requests", int, "in-flight requests before 429 (default 128)"),
    ("--max-best-of", int, "upper bound of best_of (default 2)"),
    ("--max-stop-sequences", int, "upper bound of stop sequences (default 4)"),
    ("--max-top-n-tokens", int, "upper bound of top_n_tokens (default 5)"),
    ("--max-input-tokens", int, "max prompt tokens (default: from warmup)"),
    ("--max-input-length", int, "legacy alias of --max-input-tokens"),
    ("--max-total-tokens", int, "max prompt + new tokens per request (default: from warmup)"),
    ("--waiting-served-ratio", float, "min new-batch size relative to running, only for shards "
     "that do not chunk prompts (default 0.3)"),
    ("--max-batch-prefill-tokens", int, "token budget of one prefill (default: measured "
     "by the shards at warmup)"),
    ("--max-batch-total-tokens", int, "KV token budget (default: from warmup)"),
    ("--max-waiting-tokens", int, "decode steps before waiting requests join, only for shards "
     "that do not chunk prompts (default 20)"),
    ("--max-decode-steps", int, "decode steps one shard call may run back to back while "
     "nothing waits to join (the router's turn and the gRPC round trip paid once per that many "
     "tokens; a request arriving, or a running one cancelled, meanwhile cuts the call short); 1: one "
     "step per call "
     f"(default {MAX_DECODE_STEPS})"),
    ("--max-decode-call-ms", int, "the longest a multi-step call is planned to run: its steps "
     "are as many as fit at the last call's time per step, bounding a stream's token bursts "
     f"and the tokens computed past a cancel; 0: no bound (default {MAX_DECODE_CALL_MS})"),
    ("--max-batch-size", int, "hard cap on requests per batch"),
    ("--max-queue-size", int, "waiting requests before 429, < --max-concurrent-requests "
     "(default: none, the permits bound queued + running)"),
    ("--max-client-batch-size", int, "max prompts in one /v1/completions request (default 4)"),
    ("--payload-limit", int, "HTTP body limit in bytes (default 2000000)"),
    ("--max-connections", int, "open HTTP connections before new ones get 503 (default 1024)"),
    ("--validation-workers", int, "tokenizer workers in the router (default 2)"),
    ("--max-grammar-bytes", int, "longest `grammar` / `response_format` schema or regex the "
     "router compiles, in bytes of compact JSON; longer ones get 422 (default 65536)"),
    ("--responses-store-bytes", int, "memory the router keeps stored /v1/responses in (GET by "
     "id, previous_response_id), bytes of JSON, per replica, LRU; 0 stores none (default "
     "67108864)"),
    *MEDIA_FLAGS,
    ("--grammar-cache-bytes", int, "memory each shard gives grammars and the matchers prepared "
     "for queued constrained requests (estimated; default 536870912)"),
    ("--tokenizer-config-path", str, "alternate tokenizer_config.json (e.g. a chat_template)"),
    ("--reasoning-parser", str, "the router splits the model's thinking from its answer "
     "(`reasoning_content`), vLLM's names; none: never (default: detected from the chat "
     "template where it is unambiguous)"),
    ("--hostname", str, "HTTP bind address (default 0.0.0.0)"),
    ("--port", int, "HTTP port (default 3000)"),
    ("--api-key", str, "require `Authorization: Bearer <key>` on generation routes (or "
     "`x-api-key: <key>` on Anthropic's /v1/messages)"),
    ("--shard-uds-path", str, f"shard socket base name, rank r on PATH-r (default "
     f"{DEFAULT_UDS_PATH} on --port 3000, {DEFAULT_UDS_PATH}-PORT on another port)"),
    ("--master-addr", str, "torch.distributed rendezvous address (default localhost)"),
    ("--master-port", int, "torch.distributed rendezvous port (default: a free port)"),
    ("--shard-token", str, "shared secret of the shards' gRPC, passed to shards and router "
     "(SHARD_TOKEN is better: argv is visible to every user)"),
    ("--cuda-memory-fraction", float, "share of each GPU a shard may use (default 1.0)"),
    ("--attention", str, "shard attention backend (default: the shard's choice)"),
    ("--cuda-graphs", str, "decode batch sizes captured as CUDA graphs, comma list like 1,2,4,8; "
     "0 disables (default: 1,2,4,...,256 capped at --max-batch-size)"),
    ("--cpu-graphs", str, "on CPU shards, decode batch sizes whose forward is compiled "
     "(torch.compile), comma list like 1,4,16,64; 0 or unset: eager"),
    ("--watermark-gamma", float, "watermark green-list fraction (default 0.5)"),
    ("--watermark-delta", float, "watermark logit bias (default 2.0)"),
    ("--huggingface-hub-cache", str, "Hub cache directory (default: huggingface_hub's)"),
    ("--weights-cache-override", str, "directory that directly holds the model's files"),
    ("--otlp-endpoint", str, "OTLP gRPC collector for traces, e.g. http://localhost:4317"),
    ("--otlp-service-name", str, "service.name of router and shards' traces"),
    ("--step-timeline", str, "rank 0's shard appends each engine step's phases (build, forward, "
     "token choice, device wait, host work; device time) to this JSON-lines file; `python -m "
     "pytgi_bench.compare.timeline_summary PATH` summarises it (default: none)"),
    ("--shard-startup-timeout", float, "seconds each start-up phase may take (default 600)"),
    ("--max-shard-restarts", int, "restarts of the shard group after a shard dies, with backoff; "
     "the router stays up and reconnects (0: stop everything, as TGI; default 3)"),
    ("--graceful-termination-timeout", float, "seconds between SIGTERM and SIGKILL (default 90)"),
    ("--drain-grace-seconds", float, "after SIGTERM, seconds the router's /health answers 503 while "
     "it still admits requests, before the drain (default 5)"),
]
_SWITCHES: list[tuple[str, str]] = [
    ("--trust-remote-code", "allow the model's own code from the Hub"),
    ("--disable-grammar-support", "reject `grammar` / `response_format`"),
    ("--enable-lora-runtime-updates", "serve vLLM's POST /v1/load_lora_adapter and "
     "/v1/unload_lora_adapter (behind --api-key when set): load and unload LoRA adapters live"),
    ("--allow-media-urls", ALLOW_MEDIA_URLS_HELP),
    ("--json-output", "JSON log lines (launcher, router and shards)"),
    ("--disable-custom-kernels", "shards run plain PyTorch only: reference attention, no Triton "
     "norm/rotary/activation/MoE/dequantize kernels"),
]
# Accepted because TGI deployments pass them; they change nothing in pytgi.
_ACCEPTED: list[str] = ["--prometheus-port", "--usage-stats"]
# TGI's switches that state what pytgi always does (shown in --help, so nobody expects more).
_ACCEPTED_SWITCHES: list[tuple[str, str]] = [
    ("--enable-prefill-logprobs", "accepted for TGI compatibility: pytgi always serves prompt "
     "logprobs (`decoder_input_details`), computed per prefill chunk, so a request asking for "
     "them holds about 3 copies of (--max-batch-prefill-tokens x vocabulary) logits at a time "
     "(TGI 3 drops them unless this is given)"),
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pytgi-launcher",
        description="Starts pytgi: the model's shards, then the HTTP router in front of them. "
        "Every flag can also be given as an environment variable (--max-total-tokens -> "
        "MAX_TOTAL_TOKENS); the command line wins.",
        argument_default=argparse.SUPPRESS,
    )
    for flag, kind, text in _VALUED:
        names = ["-p", flag] if flag == "--port" else [flag]
        choices = {"--dtype": DTYPES, "--rope-scaling": ROPE_SCALINGS,
                   "--kv-cache-dtype": KV_CACHE_DTYPES,
                   "--reasoning-parser": (*PARSER_NAMES, NO_PARSER)}.get(flag)
        p.add_argument(*names, type=kind, help=text, choices=choices)
    p.add_argument("--sharded", type=parse_bool, metavar="{true,false}",
                   help="true: shard across all visible GPUs; false: one shard")
    p.add_argument("--prefix-caching", type=parse_bool, metavar="{true,false}",
                   help="the router reuses the KV of prompt prefixes already computed "
                        "(default true)")
    p.add_argument("--cors-allow-origin", action="append", help="allowed CORS origin (repeatable)")
    for flag, text in _SWITCHES:
        p.add_argument(flag, action="store_true", help=text)
    for flag in _ACCEPTED:
        p.add_argument(flag, help=argparse.SUPPRESS)
    for flag, text in _ACCEPTED_SWITCHES:
        p.add_argument(flag, action="store_true", help=text)
    p.add_argument("-e", "--env", action="store_true",
                   help="print the environment report (versions, CPU, GPUs) and exit")
    add_version_flag(p)
    return p


def parse_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> LauncherSettings:
    """Command line > environment > defaults (exits 2 with a usage message on bad input)."""
    environ = os.environ if environ is None else environ
    parser = build_parser()
    cli = vars(parser.parse_args(argv))
    values = env_values(parser, environ, skip=("env", "version"))
    values.update(cli)
    resolve_input_length_alias(parser, values, cli)
    for flag in [*_ACCEPTED, *(flag for flag, _ in _ACCEPTED_SWITCHES)]:
        values.pop(flag.lstrip("-").replace("-", "_"), None)
    if "cors_allow_origin" in values:
        values["cors_allow_origin"] = tuple(values["cors_allow_origin"])
    try:
        return LauncherSettings(**values)
    except ValueError as err:
        parser.error(str(err))
        raise  # unreachable: parser.error exits


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(argv)
    if settings.env:
        from pytgi_launcher.env_report import environment_report

        print(environment_report())
        return 0
    from pytgi_launcher.launch import launch

    return launch(settings, dict(os.environ))


if __name__ == "__main__":
    sys.exit(main())
