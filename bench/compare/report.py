"""The JSON document bench/compare/run.py saves: settings, model, workload, every row, the targets."""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any

from pytgi_bench.compare import settings as compare_settings
from pytgi_bench.compare.system_result import SystemResult
from pytgi_bench.compare.table import check_targets

Prompts = list[tuple[str, list[int]]]


def compare_document(
    args: argparse.Namespace, setup: dict[str, Any], results: list[SystemResult], complete: bool
) -> dict[str, Any]:
    """`setup`: model_dir, model_desc, prompts (the timed workload), single (the single-stream
    prompts, or None when no single-stream row ran). `complete` is False while rows are still
    to come (the document is saved after every row)."""
    model_dir: Path = setup["model_dir"]
    prompts: Prompts = setup["prompts"]
    single: Prompts | None = setup["single"]
    return {
        "tool": "python -m pytgi_bench.compare",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "complete": complete,
        "note": args.note,
        "mode": "gpu" if args.gpu else "cpu",
        "threads": None if args.gpu else args.threads,
        "attention": args.attention,
        "server_args": compare_settings.server_argv(args),
        "model": {
            "path": str(model_dir),
            "description": setup["model_desc"],
            "config": json.loads((model_dir / "config.json").read_text()),
        },
        "workload": {
            "requests": args.requests,
            "new_tokens": args.new_tokens,
            "input_len": str(args.input_len),
            "repeats": args.repeats,
            "prompt_tokens": [len(ids) for _, ids in prompts],
            "hf_sequential_timed_requests": args.sequential_requests,
            "hf_cb_timed_requests": args.cb_requests,
            "subsets": "hf-sequential and hf-cb are timed on the first N requests when their "
            "timed_requests is set; their tok/s stands for the whole workload",
            "single_stream": None if single is None else {
                "requests": len(single),
                "prompt_tokens": [len(ids) for _, ids in single],
                "new_tokens": args.single_new_tokens,
                "pytgi_warmup_requests": 1,
            },
        },
        "results": [r.to_json() for r in results],
        "targets": [c.to_json() for c in check_targets(results)],
    }
