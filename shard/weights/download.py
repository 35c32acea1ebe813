"""`pytgi-shard download-weights [MODEL_ID]`: TGI's pre-fetch command.

Resolves MODEL_ID as the launcher does (shard/weights/resolution.py: a local folder, the weights
cache override or a Hub snapshot, `.bin` converted once) and prints the resolved local folder on
stdout (logs go to stderr), for scripts and containers.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from pytgi_shard.weights.resolution import ModelNotFound, WeightsSource, hub_token, resolve_model


def add_download_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "download-weights", help="fetch a Hub model into the cache (and convert .bin once)"
    )
    p.add_argument("model_id", nargs="?",
                   help="Hub repo id or local directory (default: the bundled demo model)")
    p.add_argument("--revision", help="Hub revision (branch, tag or commit)")
    p.add_argument("--metadata-only", action="store_true",
                   help="config and tokenizer files only (what a router needs)")
    p.add_argument("--huggingface-hub-cache", help="cache directory (env HUGGINGFACE_HUB_CACHE)")
    p.add_argument("--weights-cache-override", help="env WEIGHTS_CACHE_OVERRIDE")
    # TGI's launcher passes these; pytgi's behaviour is already what they ask for.
    p.add_argument("--extension", default=".safetensors", help=argparse.SUPPRESS)
    p.add_argument("--auto-convert", default="true", help=argparse.SUPPRESS)
    p.add_argument("--logger-level", default="INFO", help=argparse.SUPPRESS)
    p.add_argument("--json-output", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--trust-remote-code", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--merge-lora", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=run_download)


def bundled_demo_model() -> Path:
    """The small model shipped as package data of pytgi_launcher (launcher/demo_model), the
    default MODEL_ID here as in the launcher.

    Located through the import system's record of where that package lives, which runs none of
    its code: the shard depends on the launcher's data folder, never on its modules.
    """
    spec = importlib.util.find_spec("pytgi_launcher")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound("the bundled demo model is not installed: name a MODEL_ID")
    return Path(next(iter(spec.submodule_search_locations))) / "demo_model"


def source_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> WeightsSource:
    return WeightsSource(
        model_id=args.model_id if args.model_id is not None else str(bundled_demo_model()),
        revision=args.revision,
        huggingface_hub_cache=args.huggingface_hub_cache or env.get("HUGGINGFACE_HUB_CACHE"),
        weights_cache_override=args.weights_cache_override or env.get("WEIGHTS_CACHE_OVERRIDE"),
        metadata_only=args.metadata_only,
        token=hub_token(env),
    )


def run_download(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.logger_level.upper(), format="%(levelname)s %(message)s")
    try:
        path = resolve_model(source_from_args(args, os.environ))
    except ModelNotFound as e:
        print(f"pytgi-shard download-weights: error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
