"""A newcomer's TTFT on a busy server, before and after cutting multi-step calls short (issue 34):
servers of two source trees (the code before and after a change, e.g. `git archive <commit> |
tar -x -C DIR` of each), same flags, side by side on the demo model; rounds alternate their
order. The probe is `cpu_multi_step.busy_ttft_ms`: single requests sent one at a time while
another stream decodes.

    python -m pytgi_bench.experiments.cut_short_pair --before /tmp/old --after /tmp/new \
        --steps 8,16 --rounds 3 --out bench/results/cpu/multi_step_cut_short_paired.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from pytgi_bench.compare.llama_cpp import _load
from pytgi_bench.compare.llama_cpp_build import DEMO_MODEL
from pytgi_bench.compare.run import build_prompts
from pytgi_bench.compare.server_process import PytgiServer
from pytgi_bench.experiments.cpu_multi_step import busy_ttft_ms, cut_short_calls, save
from pytgi_bench.settings import LengthRange

PACKAGES = {"pytgi_proto": "proto", "pytgi_router": "router", "pytgi_shard": "shard",
            "pytgi_launcher": "launcher", "pytgi_bench": "bench"}


def import_path(tree: Path) -> Path:
    """A folder that makes `tree`'s packages importable ahead of the installed ones (PYTHONPATH
    comes before the editable install's finder): one link per package."""
    path = tree / ".pypath"
    path.mkdir(exist_ok=True)
    for name, folder in PACKAGES.items():
        link = path / name
        if not link.exists():
            link.symlink_to(tree / folder)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="source tree before")
    parser.add_argument("--after", type=Path, required=True, help="source tree after")
    parser.add_argument("--steps", default="8,16", help="--max-decode-steps of each pair")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=Path("build/cut-short-pair"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    steps = [int(s) for s in args.steps.split(",")]
    prompts = [t for t, _ in build_prompts(DEMO_MODEL, 12, LengthRange(16, 64), seed=34)]
    single, warm = prompts[:8], prompts[8:]
    servers: dict[str, PytgiServer] = {}
    saved = os.environ.get("PYTHONPATH")
    try:
        for code, tree in (("before", args.before), ("after", args.after)):
            os.environ["PYTHONPATH"] = str(import_path(tree.resolve()))
            for k in steps:
                name = f"{code} k={k}"
                server = PytgiServer(DEMO_MODEL, args.work_dir / f"{code}-k{k}.log",
                                     threads=args.threads,
                                     extra_args=["--max-decode-steps", str(k)])
                server.__enter__()
                servers[name] = server
        if saved is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = saved
        for server in servers.values():
            _load(server.url, warm, 16, None, args.work_dir, "warm")
        rounds: list[dict[str, float]] = []
        for index in range(args.rounds):
            order = list(servers) if index % 2 == 0 else list(servers)[::-1]
            row = {name: busy_ttft_ms(servers[name].url, single, args.work_dir, "busy")
                   for name in order}
            row["load"] = os.getloadavg()[0]
            rounds.append(row)
            print(json.dumps(row), flush=True)
        cuts = {name: cut_short_calls(server.url) for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.__exit__(None, None, None)
    result = {"issue": 34, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "probe": "busy TTFT p50 ms: 8 requests one at a time while a stream decodes",
              "medians": {key: statistics.median(r[key] for r in rounds) for key in rounds[0]},
              "calls_cut_short": cuts, "rounds": rounds}
    print(json.dumps(result, indent=1))
    save(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
