"""The end of bench/gpu.sh: one table of what each stage did, and summary.json / steps.json.

    python -P bench/compare/gpu_summary.py --stages WORK/stages.tsv --work WORK --out OUT

Standard library only (torch and friends are asked for their versions if they import), so that
the summary comes even when installing pytgi failed.

Reads the stage list gpu.sh wrote (name, status, exit code, seconds, cap), and what the stages
left: the requirements check and model builds (work directory), the engine_steps JSON of each
shape and attention (merged into OUT/steps.json), pytest's JUnit XML and compare.py's JSON (OUT).
The step timelines those left (each pytgi row's, each engine_steps row's: where the time went per
step kind, bench/compare/timeline_summary.py) go into summary.json's `timelines` and are printed
before the table. Prints the table last, so it is what the end of a run's output shows. A stage
that left nothing readable says so rather than failing the summary.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any


@dataclass(slots=True)
class StageRow:
    name: str
    status: str
    exit_code: str
    seconds: int
    cap_s: str
    result: str = ""


def read_stages(path: Path) -> list[StageRow]:
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) == 5:
            rows.append(StageRow(parts[0], parts[1], parts[2], int(parts[3]), parts[4]))
    return rows


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def install_result(work: Path) -> str:
    report = _json(work / "requirements.json")
    if report is None:
        return "no requirements report"
    missing = [p["name"] for p in report.get("missing", [])]
    warned = len(report.get("outside_range", []))
    text = f"{len(report.get('checked', []))} distributions present"
    text += f"; MISSING {', '.join(missing)}" if missing else "; nothing missing"
    return text + (f"; {warned} version warnings (gpu.log)" if warned else "")


def tests_result(out: Path) -> str:
    try:
        root = ET.parse(out / "tests.xml").getroot()
    except (OSError, ET.ParseError):
        return "no tests.xml"
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    keys = ("tests", "failures", "errors", "skipped")
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in keys}
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    failed = [
        f"{case.get('classname', '')}.{case.get('name', '')}"
        for case in root.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    text = (f"{passed} passed, {count['failures']} failed, {count['errors']} errors, "
            f"{count['skipped']} skipped")
    return text + (f" (first: {failed[0].rsplit('.', 2)[-1]})" if failed else "")


def merge_steps(work: Path, out: Path) -> dict[str, Any]:
    """engine_steps' JSON per `<shape>-<attention>` run, as one document in OUT/steps.json."""
    runs = {p.stem: _json(p) for p in sorted((work / "steps").glob("*.json"))}
    runs = {name: data for name, data in runs.items() if data is not None}
    if runs:
        (out / "steps.json").write_text(json.dumps({"tool": "pytgi_bench.compare.engine_steps",
                                                    "runs": runs}, indent=2))
    return runs


def steps_result(runs: dict[str, Any]) -> str:
    parts = []
    for name, data in runs.items():
        cells = ", ".join(
            f"b{r['batch_size']}{' overlap' if r.get('overlap') else ''} {r['decode_ms']:.2f} ms "
            f"({r['tokens_per_s']:,.0f} tok/s)"
            for r in data.get("rows", [])
        )
        parts.append(f"{name}: {cells}")
    return "; ".join(parts) if parts else "no engine_steps results"


def timeline_module() -> ModuleType:
    """bench/compare/timeline_summary.py, loaded by its path: this file runs as a script (-P),
    where bench/compare is no package and pytgi may not have installed; that module is
    standard library only too."""
    name = "_gpu_summary_timeline"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).with_name("timeline_summary.py")
        )
        assert spec is not None and spec.loader is not None
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def collect_timelines(stages: list[StageRow], steps: dict[str, Any],
                      out: Path) -> dict[str, dict[str, Any]]:
    """Every step timeline summary the stages left, by `<stage> <row>`."""
    found: dict[str, dict[str, Any]] = {}
    for row in stages:
        if not row.name.startswith("compare-"):
            continue
        for system, result in _rows(_json(out / f"{row.name}.json") or {}).items():
            timeline = result.get("extra", {}).get("timeline")
            if isinstance(timeline, dict) and "steps" in timeline:
                found[f"{row.name} {system}"] = timeline
    ran_steps = any(row.name == "steps" and row.status != "skipped" for row in stages)
    for name, data in steps.items() if ran_steps else ():
        for r in data.get("rows", []):
            if isinstance(r.get("timeline"), dict):
                overlap = "overlap" if r.get("overlap") else "no overlap"
                found[f"steps {name} b{r['batch_size']} {overlap}"] = r["timeline"]
    return found


def _idle(report: dict[str, Any] | None) -> str:
    """The device's idle share during pytgi-http's timed window, from its step timeline."""
    timeline = _rows(report or {}).get("pytgi-http", {}).get("extra", {}).get("timeline")
    if not isinstance(timeline, dict) or timeline.get("device_idle_share") is None:
        return ""
    return f"device idle {timeline['device_idle_share']:.0%} over {timeline['steps']} steps"


def _rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["system"]: r for r in report.get("results", [])}


def _single(row: dict[str, Any] | None) -> dict[str, float] | None:
    rounds = (row or {}).get("extra", {}).get("single_stream")
    if not rounds or (row or {}).get("status") != "ok":
        return None
    return {k: statistics.median(r[k] for r in rounds) for k in ("ttft_ms", "tpot_ms")}


def compare_result(report: dict[str, Any] | None) -> str:
    if report is None:
        return "no compare JSON"
    rows = _rows(report)
    parts = []
    # The smoke run's CPU row is the patched one (transformers' memory probe fails on a CPU).
    name = "hf-cb" if "hf-cb" in rows else "hf-cb-cpu-patched"
    ours, cb = rows.get("pytgi-http"), rows.get(name)
    if ours is not None:
        speed = ours.get("tokens_per_s")
        text = f"pytgi {speed:,.0f} tok/s" if speed else f"pytgi {ours['status']}"
        if cb is not None:
            theirs = cb.get("tokens_per_s")
            text += f" vs {name} {theirs:,.0f}" if theirs else f" vs {name} {cb['status']}"
            if speed and theirs:
                text += f" ({speed / theirs:.2f}x)"
        parts.append(text)
    a, b = _single(rows.get("pytgi-http-b1")), _single(rows.get("hf-compiled-b1"))
    if a or b:
        def ms(x: dict[str, float] | None, key: str, spec: str) -> str:
            return format(x[key], spec) if x else "-"

        parts.append(f"TPOT {ms(a, 'tpot_ms', '.2f')} vs {ms(b, 'tpot_ms', '.2f')} ms, "
                     f"TTFT {ms(a, 'ttft_ms', '.1f')} vs {ms(b, 'ttft_ms', '.1f')} ms")
    idle = _idle(report)
    if idle:
        parts.append(idle)
    broken = [f"{name} {r['status']}" for name, r in rows.items() if r.get("status") != "ok"]
    if broken:
        parts.append("not ok: " + ", ".join(broken))
    return "; ".join(parts) or "no rows"


def quantization_result(report: dict[str, Any] | None) -> str:
    """Each --quantize mode's best decode tok/s per batch size (pytgi_bench.experiments.quantization)."""
    if report is None:
        return "no quantization JSON"
    parts = []
    for mode in report.get("modes", []):
        if mode.get("error"):
            parts.append(f"{mode['mode']} not run")
            continue
        best = ", ".join(f"b{size} {tok_s:,.0f}" for size, tok_s in mode.get("best", {}).items())
        parts.append(f"{mode['mode']} {best} tok/s")
    return "; ".join(parts) or "no modes"


def speculative_result(report: dict[str, Any] | None) -> str:
    """Each workload's tokens/s without and with drafts (pytgi_bench.experiments.speculative)."""
    if report is None:
        return "no speculative JSON"
    parts = [
        f"{r['workload']}: {r['tokens_per_s_speculate_0']} -> {r['tokens_per_s_speculate_4']} "
        f"tok/s (x{r['speedup']}, accepted length {r['mean_accepted_length']})"
        for r in report.get("results", [])
    ]
    return "; ".join(parts) or "no workloads"


def _models(work: Path) -> list[dict[str, Any]]:
    """One record per shape: its build when this run built it, else the first time it was found."""
    path = work / "models.jsonl"
    if not path.is_file():
        return []
    by_shape: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line) if line.strip() else None
        if record is None:
            continue
        known = by_shape.get(record["shape"])
        if known is None or (known.get("reused") and not record.get("reused")):
            by_shape[record["shape"]] = record
    return list(by_shape.values())


def _environment() -> dict[str, Any]:
    """Versions and the GPU, as the summary's header: best effort, never fatal."""
    env: dict[str, Any] = {}
    try:
        import torch

        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
        import transformers

        env["transformers"] = transformers.__version__
        import triton

        env["triton"] = triton.__version__
    except Exception as exc:  # a broken import is reported, not raised, at the end of a run
        env["import_error"] = f"{type(exc).__name__}: {exc}"
    return env


def keep_headline_timeline(stages: list[StageRow], work: Path, out: Path) -> None:
    """The 8B server's steps one by one (a few hundred lines) as OUT/timeline-8b.jsonl: what
    the per-kind summary cannot answer (how the burst's prefill and decode steps follow each
    other) stays answerable without a GPU. Copied here, so a stage cut at its cap keeps it."""
    source = work / "compare-8b" / "pytgi-timeline.jsonl"
    if any(r.name == "compare-8b" and r.status != "skipped" for r in stages) and source.is_file():
        shutil.copyfile(source, out / "timeline-8b.jsonl")


def summarize(stages: list[StageRow], work: Path, out: Path) -> dict[str, Any]:
    keep_headline_timeline(stages, work, out)
    steps = merge_steps(work, out)
    for row in stages:
        if row.status == "skipped":
            row.result = "not run: no time left in the budget"
        elif row.name == "install":
            row.result = install_result(work)
        elif row.name == "tests":
            row.result = tests_result(out)
        elif row.name == "steps":
            row.result = steps_result(steps)
        elif row.name.startswith("compare-"):
            row.result = compare_result(_json(out / f"{row.name}.json"))
        elif row.name == "quantization":
            row.result = quantization_result(_json(out / "quantization.json"))
        elif row.name == "speculative":
            row.result = speculative_result(_json(out / "speculative.json"))
    return {"stages": [asdict(r) for r in stages], "models": _models(work),
            "environment": _environment(), "timelines": collect_timelines(stages, steps, out)}


def print_timelines(timelines: dict[str, dict[str, Any]], stream: Any) -> None:
    """Where the time went: each pytgi row's table per step kind, one line per steps row."""
    if not timelines:
        return
    module = timeline_module()
    print("===== step timelines (shard/engine/step_timeline.py) =====", file=stream)
    for name, timeline in timelines.items():
        if name.startswith("steps "):
            print(f"{name}: {module.headline(timeline)}", file=stream)
        else:
            module.print_summary(timeline, name, stream)


def print_summary(summary: dict[str, Any], seconds: int | None, stream: Any) -> None:
    print_timelines(summary.get("timelines", {}), stream)
    env = summary["environment"]
    head = ", ".join(f"{k} {v}" for k, v in env.items())
    print(f"===== bench/gpu.sh summary ({head}) =====", file=stream)
    print(f"{'stage':<11} {'status':<8} {'s':>5}  result", file=stream)
    for row in summary["stages"]:
        status = row["status"] if row["status"] == "ok" else row["status"].upper()
        print(f"{row['name']:<11} {status:<8} {row['seconds']:>5}  {row['result']}", file=stream)
    for m in summary["models"]:
        how = "found" if m.get("reused") else f"built in {m['seconds']:.0f} s"
        print(f"model {m['shape']}: {how}, {m['bytes'] / 2**30:.1f} GiB {m['dtype']}", file=stream)
    bad = [r["name"] for r in summary["stages"] if r["status"] != "ok"]
    total = f" in {seconds} s" if seconds is not None else ""
    print(f"NOT OK: {', '.join(bad)}{total}" if bad else f"all stages ok{total}", file=stream)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pytgi_bench.compare.gpu_summary", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=Path, required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seconds", type=int, default=None, help="the whole run's wall time")
    args = p.parse_args(argv)
    summary = summarize(read_stages(args.stages), args.work, args.out)
    summary["seconds"] = args.seconds
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print_summary(summary, args.seconds, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
