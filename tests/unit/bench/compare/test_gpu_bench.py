"""bench/gpu.sh's pieces that need no GPU: the wheel list, the requirements check, the stage
plan, compare's GPU settings and single-stream table, and the summary at the end of a run.

`bench/gpu.sh --cpu-smoke` runs the whole script on the CPU (minutes); these are the fast checks.
"""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from pytgi_bench.compare import gpu_summary
from pytgi_bench.compare import settings as compare_settings
from pytgi_bench.compare.hf_baselines import _served_window
from pytgi_bench.compare.run import _merge
from pytgi_bench.compare.system_result import SystemResult
from pytgi_bench.compare.table import check_targets, print_table
from pytgi_bench.requirements_check import check

ROOT = Path(__file__).resolve().parents[4]
WHEELS = ROOT / "bench" / "gpu-wheels.txt"
GPU_SH = ROOT / "bench" / "gpu.sh"


def _wheel_pins() -> dict[str, Requirement]:
    pins = {}
    for line in WHEELS.read_text().splitlines():
        text = line.split(" #", 1)[0].strip()
        if text and not text.startswith("#"):
            requirement = Requirement(text)
            name = canonicalize_name(requirement.name)
            assert name not in pins, f"{name} is listed twice"
            pins[name] = requirement
    return pins


def _provided() -> set[str]:
    (line,) = [s for s in WHEELS.read_text().splitlines() if s.startswith("# provided:")]
    return {canonicalize_name(n) for n in line.removeprefix("# provided:").split()}


def _pyproject_requirements() -> tuple[list[Requirement], list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for group in project["optional-dependencies"].values() for r in group]
    return [Requirement(r) for r in project["dependencies"]], [Requirement(r) for r in extras]


def test_every_wheel_is_pinned_and_within_what_pyproject_allows() -> None:
    pins = _wheel_pins()
    runtime, extras = _pyproject_requirements()
    for requirement in [*runtime, *extras]:
        pin = pins.get(canonicalize_name(requirement.name))
        if pin is None:
            continue
        (spec,) = pin.specifier
        assert spec.operator == "==", f"{pin} must be an exact pin"
        assert requirement.specifier.contains(spec.version), f"{pin} is outside {requirement}"


def test_every_runtime_dependency_is_a_wheel_or_provided_by_the_gpu_machine() -> None:
    pins, provided = _wheel_pins(), _provided()
    runtime, _ = _pyproject_requirements()
    for requirement in runtime:
        name = canonicalize_name(requirement.name)
        assert name in pins or name in provided, f"{name}: neither in gpu-wheels.txt nor provided"
    assert not set(pins) & provided, "a provided package would be shadowed by a wheel"
    # The machine's own CUDA torch must never be replaced by the wheels.
    assert "torch" not in pins and "triton" not in pins


def test_requirements_check_walks_dependencies_with_markers_and_extras() -> None:
    installed = {"app": "1.0", "lib": "2.0", "old": "0.9", "dev": "1.0", "shared": "3.0"}
    requires = {
        "app": ["lib>=2", "old>=1", "gone", "shared", "dev; extra == 'test'",
                "win-only; sys_platform == 'win32'"],
        "lib": ["shared<4", "app"],  # a cycle back to the root
        "dev": ["missing-dev"],
    }
    report = check(["app"], installed.get, lambda n: requires.get(n, []))
    assert [p.name for p in report.missing] == ["gone"]
    assert [(p.name, p.found, p.wanted) for p in report.outside_range] == [("old", "0.9", ">=1")]
    assert report.checked == ["app==1.0", "lib==2.0", "old==0.9", "shared==3.0"]
    assert not report.ok
    with_extra = check(["app[test]"], installed.get, lambda n: requires.get(n, []))
    assert {p.name for p in with_extra.missing} == {"gone", "missing-dev"}
    # A trusted distribution is checked itself, but what it needs is not walked.
    trusting = check(["app[test]"], installed.get, lambda n: requires.get(n, []), trusted=["Dev"])
    assert {p.name for p in trusting.missing} == {"gone"} and "dev==1.0" in trusting.checked


def test_requirements_check_passes_on_this_environment() -> None:
    report = check(["pytgi"])
    assert report.ok, report.missing
    assert any(c.startswith("grpcio==") for c in report.checked)


def test_the_smoke_install_asks_with_the_tags_make_gpu_wheels_downloads_for() -> None:
    """pip matches manylinux tags exactly: a level missing from `make gpu-wheels` drops a pinned
    wheel (llguidance's is manylinux_2_31) and the GPU machine's install fails; the smoke run
    proves the list resolves only if it asks with the same tags, which it reads from make."""
    tags = subprocess.run(["make", "-s", "--no-print-directory", "-C", str(ROOT), "gpu-wheel-tags"],
                          capture_output=True, text=True, check=True).stdout.split()
    assert "manylinux_2_31_x86_64" in tags and "3.12" in tags
    script = GPU_SH.read_text()
    assert "gpu-wheel-tags" in script and "--platform" not in script


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(GPU_SH), *args, "--plan"], capture_output=True, text=True)


def test_gpu_sh_is_valid_bash_and_runs_stages_in_their_order() -> None:
    assert subprocess.run(["bash", "-n", str(GPU_SH)]).returncode == 0
    every = _plan()
    assert every.returncode == 0
    lines = every.stdout.splitlines()
    # In order of value: the CUDA tests, then the 8B headline, then the 1B and kernel stages.
    assert lines[0] == (
        "stages: install tests compare-8b speculative lora steps compare-1b quantization "
        "(budget 540 s)"
    )
    # A quarter-hour window: the caps fit the 9-minute budget, install included.
    caps = [int(line.split("cap ")[1].removesuffix(" s")) for line in lines[1:]]
    assert len(caps) == 8 and sum(caps) <= 540
    # Re-measuring one stage: the install comes along (it skips itself when done before).
    chosen = _plan("--stages", "compare-8b,tests", "--cap", "tests=42")
    assert chosen.stdout.splitlines() == [
        "stages: install tests compare-8b (budget 540 s)", "  install: cap 30 s",
        "  tests: cap 42 s", "  compare-8b: cap 175 s",
    ]
    bare = _plan("--stages", "compare-8b", "--no-install", "--budget-s", "240")
    assert bare.stdout.splitlines()[0] == "stages: compare-8b (budget 240 s)"
    wrong = _plan("--stages", "tests,benchmark")
    assert wrong.returncode == 2 and "unknown stage 'benchmark'" in wrong.stderr
    late = _plan("--cap", "tests=1m")
    assert late.returncode == 2 and "--cap tests takes whole seconds, got '1m'" in late.stderr
    # The smoke run's caps are the GPU's times 4 (a shared CPU), its budget too unless given.
    smoke = _plan("--cpu-smoke", "--stages", "tests", "--cap", "install=7")
    assert smoke.stdout.splitlines() == [
        "stages: install tests (budget 2160 s)", "  install: cap 7 s", "  tests: cap 360 s"
    ]


def test_the_tests_stage_selects_the_cuda_tests_that_exist() -> None:
    """The kernel tests moved into folders once and the stage's glob silently matched nothing:
    its selection is listed by the script itself and every entry must exist."""
    listed = subprocess.run(
        ["bash", "-c", f"source <(sed -n '/^tests_files()/,/^}}/p' {GPU_SH}); cd {ROOT}; "
         "tests_files"], capture_output=True, text=True, check=True,
    ).stdout.split()
    assert listed[0] == "tests/gpu/" and len(listed) >= 6
    assert all((ROOT / path).exists() for path in listed)
    assert any(p.endswith("test_triton_attention.py") for p in listed)


def test_compare_fills_the_defaults_of_each_mode() -> None:
    gpu = compare_settings.parse(["--gpu", "--attention", "triton", "--server-args", "--x 1"], "")
    workload = (gpu.requests, gpu.new_tokens, str(gpu.input_len), gpu.repeats)
    assert workload == (256, 128, "128:1024", 1)
    assert (gpu.single_input_len, gpu.single_new_tokens, gpu.cb_requests) == (512, 128, 64)
    assert gpu.shape == "8b" and gpu.system_list == list(compare_settings.GPU_SYSTEMS)
    assert compare_settings.server_argv(gpu) == [
        "--max-concurrent-requests", "256", "--num-shard", "1", "--attention", "triton", "--x", "1"
    ]
    cpu = compare_settings.parse(["--requests", "8"], "")
    assert (cpu.requests, cpu.new_tokens, cpu.repeats, cpu.cb_requests, cpu.shape) == (
        8, 64, 3, None, None
    )
    assert cpu.system_list == list(compare_settings.CPU_SYSTEMS)
    assert compare_settings.server_argv(cpu) == ["--max-concurrent-requests", "128"]
    with pytest.raises(SystemExit):
        compare_settings.parse(["--systems", "pytgi-http,vllm"], "")


def _single(system: str, ttft: float, tpot: float) -> SystemResult:
    return SystemResult(system, system, wall_s=[1.0], output_tokens=[100],
                        extra={"single_stream": [{"ttft_ms": ttft, "tpot_ms": tpot}]})


def test_single_stream_rows_are_compared_on_latency() -> None:
    results = [
        SystemResult("pytgi-http", "p", wall_s=[2.0], output_tokens=[4000]),
        SystemResult("hf-cb", "c", wall_s=[2.0], output_tokens=[1000]),
        _single("pytgi-http-b1", 20.0, 5.0),
        _single("hf-compiled-b1", 30.0, 4.0),
    ]
    ratios = sorted((round(c.ratio or 0, 2), c.passed) for c in check_targets(results))
    # Throughput 4x hf-cb; TTFT 30/20 = 1.5 (pass); TPOT 4/5 = 0.8 (miss); no CPU baselines run.
    assert ratios == [(0.8, False), (1.5, True), (4.0, True)]
    table = io.StringIO()
    print_table(results, 4000, table)
    text = table.getvalue()
    assert "pytgi-http-b1                20.0         5.00" in text
    assert "MISS  single stream: time per output token" in text


def test_merging_rounds_extends_per_round_lists() -> None:
    first = _single("pytgi-http-b1", 20.0, 5.0)
    first.extra["latency"] = {"ttft_ms": {"p50": 20.0}}
    merged = _merge(None, first)
    merged = _merge(merged, _single("pytgi-http-b1", 22.0, 6.0))
    assert merged.wall_s == [1.0, 1.0]
    assert [r["tpot_ms"] for r in merged.extra["single_stream"]] == [5.0, 6.0]
    assert merged.extra["latency_per_round"] == [{"ttft_ms": {"p50": 20.0}}]


def test_continuous_batching_is_timed_from_first_request_to_last_token() -> None:
    stamped = [SimpleNamespace(created_time=10.0, lifespan=(10.5, 14.0)),
               SimpleNamespace(created_time=10.2, lifespan=(10.6, 13.0))]
    assert _served_window(stamped) == pytest.approx(4.0)
    # transformers 4.x stamps no lifespan: the whole call is timed instead.
    assert _served_window([SimpleNamespace(created_time=1.7e9)]) is None
    assert _served_window([SimpleNamespace(created_time=1.0, lifespan=(1.0, -1))]) is None


def _write_run(work: Path, out: Path) -> None:
    (work / "steps").mkdir(parents=True)
    stages = ["install\tok\t0\t12\t90", "tests\tfailed\t1\t40\t150", "steps\tok\t0\t80\t200",
              "compare-1b\ttimeout\t124\t200\t200", "compare-8b\tskipped\t-\t0\t10"]
    (work / "stages.tsv").write_text("\n".join(stages) + "\n")
    (work / "requirements.json").write_text(json.dumps(
        {"checked": ["a==1", "b==2"], "missing": [], "outside_range": [{"name": "x"}]}))
    (work / "models.jsonl").write_text(json.dumps(
        {"shape": "1b", "path": "/m", "dtype": "bfloat16", "device": "cuda", "seconds": 15.2,
         "bytes": 2 * 2**30, "reused": False}) + "\n")
    row = {"batch_size": 1, "prefill_ms": 9.0, "decode_ms": 6.5, "forward_ms": 5.0,
           "overhead_ms": 1.5, "tokens_per_s": 153.8}
    (work / "steps" / "1b-triton.json").write_text(json.dumps({"command": "c", "rows": [row]}))
    (out / "tests.xml").write_text(
        '<testsuites><testsuite tests="5" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.gpu.test_cuda_equality" name="test_one_rank[triton]">'
        "<failure/></testcase></testsuite></testsuites>"
    )


def test_summary_reports_every_stage_and_ends_with_what_failed(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    _write_run(work, out)
    code = gpu_summary.main(["--stages", str(work / "stages.tsv"), "--work", str(work),
                             "--out", str(out), "--seconds", "332"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    results = {s["name"]: s["result"] for s in summary["stages"]}
    assert results["install"] == (
        "2 distributions present; nothing missing; 1 version warnings (gpu.log)"
    )
    assert results["tests"] == (
        "3 passed, 1 failed, 0 errors, 1 skipped (first: test_one_rank[triton])"
    )
    assert results["steps"] == "1b-triton: b1 6.50 ms (154 tok/s)"
    assert results["compare-1b"] == "no compare JSON"
    assert results["compare-8b"].startswith("not run")
    assert json.loads((out / "steps.json").read_text())["runs"]["1b-triton"]["rows"] == [
        {"batch_size": 1, "prefill_ms": 9.0, "decode_ms": 6.5, "forward_ms": 5.0,
         "overhead_ms": 1.5, "tokens_per_s": 153.8}
    ]


def test_summary_reads_compare_results() -> None:
    rows = [r.to_json() for r in (
        SystemResult("pytgi-http", "p", wall_s=[2.0], output_tokens=[4000]),
        SystemResult("hf-cb", "c", wall_s=[2.0], output_tokens=[1000]),
        _single("pytgi-http-b1", 20.0, 5.0),
        SystemResult("hf-compiled-b1", "h", status="error", error="timed out (150 s)"),
    )]
    text = gpu_summary.compare_result({"results": rows})
    assert text == ("pytgi 2,000 tok/s vs hf-cb 500 (4.00x); TPOT 5.00 vs - ms, TTFT 20.0 vs - ms; "
                    "not ok: hf-compiled-b1 error")


def test_summary_reads_the_speculative_stage() -> None:
    row = {"workload": "quoting, batch 1", "tokens_per_s_speculate_0": 120.0,
           "tokens_per_s_speculate_4": 250.5, "speedup": 2.09, "mean_accepted_length": 3.4}
    assert gpu_summary.speculative_result({"results": [row]}) == (
        "quoting, batch 1: 120.0 -> 250.5 tok/s (x2.09, accepted length 3.4)")
    assert gpu_summary.speculative_result(None) == "no speculative JSON"


def test_summary_carries_and_prints_the_step_timelines(tmp_path: Path) -> None:
    from pytgi_bench.compare.timeline_summary import summarize

    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    _write_run(work, out)
    ms = 1_000_000
    steps = [{"t_ns": i * 10 * ms, "end_ns": i * 10 * ms + 8 * ms, "kind": "decode",
              "requests": 256, "tokens": 256, "build_ns": ms, "forward_ns": 0, "choose_ns": ms,
              "ahead_ns": ms, "sync_ns": 4 * ms, "emit_ns": ms, "reply_ns": 0,
              "device_ns": 6 * ms} for i in range(5)]
    timeline = summarize(steps)
    ours = SystemResult("pytgi-http", "p", wall_s=[2.0], output_tokens=[4000],
                        extra={"timeline": timeline})
    (out / "compare-8b.json").write_text(json.dumps({"results": [ours.to_json()]}))
    (work / "compare-8b").mkdir()
    (work / "compare-8b" / "pytgi-timeline.jsonl").write_text("".join(
        json.dumps(s) + "\n" for s in steps))
    stages = (work / "stages.tsv").read_text().replace("compare-8b\tskipped\t-\t0\t10",
                                                       "compare-8b\tok\t0\t150\t210")
    (work / "stages.tsv").write_text(stages)
    steps_run = json.loads((work / "steps" / "1b-triton.json").read_text())
    steps_run["rows"][0].update(overlap=True, timeline=timeline)
    (work / "steps" / "1b-triton.json").write_text(json.dumps(steps_run))
    printed = io.StringIO()
    summary = gpu_summary.summarize(gpu_summary.read_stages(work / "stages.tsv"), work, out)
    gpu_summary.print_summary(summary, 400, printed)
    assert set(summary["timelines"]) == {"compare-8b pytgi-http", "steps 1b-triton b1 overlap"}
    # The headline's raw steps come back with the results.
    assert (out / "timeline-8b.jsonl").read_text().count("\n") == 5
    # 5 steps over 48 ms with the device busy 30 ms.
    results = {s["name"]: s["result"] for s in summary["stages"]}
    assert results["compare-8b"] == "pytgi 2,000 tok/s; device idle 38% over 5 steps"
    text = printed.getvalue()
    assert "step timeline compare-8b pytgi-http: 5 steps" in text
    assert "steps 1b-triton b1 overlap: 5 steps, device idle 38%" in text
    # The stage table still ends the output.
    assert text.rstrip().splitlines()[-1].startswith("NOT OK: tests, compare-1b")
