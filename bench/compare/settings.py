"""bench/compare/run.py's command line, with the defaults of each mode (CPU, or `--gpu`) filled in.

CPU: the workload CI's machine can run (64 requests, prompts U[16,64), 64 new tokens, 3 rounds).
GPU: the issue's workload (256 requests, prompts U[128,1024), 128 new tokens, one round), plus a
single-stream pass (prompts of 512 tokens, 128 new tokens, one request at a time) for time to
first token and decode latency, and transformers' continuous batching timed on the first 64
requests only: at its ~400 tok/s on an 8B model all 32k tokens would take over a minute of a
benchmark run that must fit in ten; its tok/s stands for the whole workload (said in the JSON).
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from pytgi_bench.settings import LengthRange

IN_PROCESS = (
    "hf-sequential",
    "hf-static",
    "hf-cb",
    "hf-cb-cpu-patched",
    "hf-compiled-b1",
    "pytgi-inprocess",
    "pytgi-grpc",
)
HTTP = ("pytgi-http-b1", "pytgi-http")
SYSTEMS = (*IN_PROCESS, *HTTP)
CPU_SYSTEMS = (
    "hf-sequential",
    "hf-static",
    "hf-cb",
    "hf-cb-cpu-patched",
    "pytgi-inprocess",
    "pytgi-grpc",
    "pytgi-http",
)
# pytgi first, in one server start; then transformers' rows, each alone on the GPU, the one
# whose compile time is hardest to foresee last.
GPU_SYSTEMS = ("pytgi-http-b1", "pytgi-http", "hf-cb", "hf-compiled-b1")

# (CPU, GPU) defaults of the options whose right value depends on the mode.
_MODE_DEFAULTS: dict[str, tuple[object, object]] = {
    "requests": (64, 256),
    "new_tokens": (64, 128),
    "input_len": (LengthRange(16, 64), LengthRange(128, 1024)),
    "repeats": (3, 1),
    "single_input_len": (32, 512),
    "single_new_tokens": (32, 128),
    "cb_requests": (None, 64),
    "sequential_requests": (None, 8),
    "systems": (",".join(CPU_SYSTEMS), ",".join(GPU_SYSTEMS)),
}


def parser(description: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pytgi_bench.compare",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--gpu", action="store_true", help="GPU mode: random Llama shapes in bfloat16")
    p.add_argument(
        "--shape",
        choices=("8b", "1b", "cpu-small"),
        default=None,
        help="random-weight model shape (GPU default 8b; CPU default: the demo model)",
    )
    p.add_argument("--model", type=Path, default=None, help="a checkpoint to use instead")
    p.add_argument("--cpu-small", action="store_true", help="same as --shape cpu-small")
    p.add_argument("--requests", type=int, default=None, help="CPU 64, GPU 256")
    p.add_argument("--new-tokens", type=int, default=None, help="CPU 64, GPU 128")
    p.add_argument(
        "--input-len",
        type=LengthRange.parse,
        default=None,
        help="prompt tokens: N or LOW:HIGH (CPU 16:64, GPU 128:1024)",
    )
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (CPU 3, GPU 1)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (CPU mode)")
    p.add_argument("--static-batch", type=int, default=64)
    p.add_argument(
        "--sequential-requests",
        type=int,
        default=None,
        help="time hf-sequential on the first N prompts only (CPU: all, GPU: 8)",
    )
    p.add_argument(
        "--cb-requests",
        type=int,
        default=None,
        help="time hf-cb on the first N prompts only (CPU: all, GPU: 64)",
    )
    p.add_argument("--single-requests", type=int, default=4,
                   help="single-stream rows: prompts sent one at a time")
    p.add_argument("--single-input-len", type=int, default=None,
                   help="single-stream prompt tokens (CPU 32, GPU 512)")
    p.add_argument("--single-new-tokens", type=int, default=None,
                   help="single-stream new tokens (CPU 32, GPU 128)")
    p.add_argument(
        "--systems",
        default=None,
        help=f"comma-separated subset of {','.join(SYSTEMS)} "
        f"(CPU default {','.join(CPU_SYSTEMS)}; GPU default {','.join(GPU_SYSTEMS)})",
    )
    p.add_argument(
        "--attention",
        default=None,
        help="pytgi's attention backend (GPU default: triton when pytgi has it; CPU: the "
        "server's default)",
    )
    p.add_argument("--server-args", default="", help="more pytgi-launcher flags, one string")
    p.add_argument("--no-step-timeline", action="store_true",
                   help="run the pytgi server without --step-timeline (its rows then carry no "
                   "timeline; for measuring what recording it costs)")
    p.add_argument(
        "--cpu-memory-gb",
        type=float,
        default=2.0,
        help="memory reported to transformers' CB on CPU (hf-cb-cpu-patched)",
    )
    p.add_argument("--system-timeout-s", type=float, default=1800.0,
                   help="wall-clock cap of each transformers or in-process row")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="scratch space (default: <tmp>/pytgi-bench)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results JSON (default bench/results/compare-{cpu,gpu}.json)",
    )
    p.add_argument("--note", default="", help="free text saved with the results")
    return p


def default_attention() -> str:
    """triton when pytgi has that backend and triton imports, else the reference."""
    import importlib.util

    from pytgi_shard.attention import BACKENDS

    has_triton = "triton" in BACKENDS and importlib.util.find_spec("triton") is not None
    return "triton" if has_triton else "reference"


def parse(argv: list[str] | None, description: str | None) -> argparse.Namespace:
    """Parses and fills every mode-dependent default; raises SystemExit on a bad value."""
    import tempfile

    p = parser(description)
    args = p.parse_args(argv)
    mode = 1 if args.gpu else 0
    for name, values in _MODE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, values[mode])
    if args.cpu_small:
        args.shape = "cpu-small"
    if args.gpu and args.shape is None and args.model is None:
        args.shape = "8b"
    if args.gpu and args.attention is None:
        args.attention = default_attention()
    if args.work_dir is None:
        args.work_dir = Path(tempfile.gettempdir()) / "pytgi-bench"
    args.system_list = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.system_list) - set(SYSTEMS))
    if unknown:
        p.error(f"unknown systems: {', '.join(unknown)} (choose from {', '.join(SYSTEMS)})")
    args.server_argv = shlex.split(args.server_args)
    return args


def server_argv(args: argparse.Namespace) -> list[str]:
    """The launcher flags of the pytgi rows."""
    flags = ["--max-concurrent-requests", str(max(128, args.requests))]
    if args.gpu:
        # One GPU, as every transformers row has.
        flags += ["--num-shard", "1"]
    if args.attention:
        flags += ["--attention", args.attention]
    return flags + args.server_argv
