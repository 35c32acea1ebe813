"""The step timeline's summary (bench/compare/timeline_summary.py): per kind, its steps, phase
percentiles, shares of the wall time and the device's idle share, from hand-made steps whose
answers are worked out here."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from pytgi_bench.compare import timeline_summary as ts

MS = 1_000_000


def _step(t_ms: float, kind: str, forward_ms: float, emit_ms: float, device_ms: float,
          requests: int = 4) -> dict[str, object]:
    """A step starting at t_ms: 1 ms of build, then its forward and its emit."""
    phases = {p: 0 for p in ts.PHASES}
    phases.update(build=MS, forward=int(forward_ms * MS), emit=int(emit_ms * MS))
    end = int(t_ms * MS) + sum(phases.values())
    return {"t_ns": int(t_ms * MS), "end_ns": end, "kind": kind, "requests": requests,
            "tokens": requests if kind == "decode" else 100 * requests,
            **{f"{p}_ns": v for p, v in phases.items()}, "device_ns": int(device_ms * MS)}


def _run() -> list[dict[str, object]]:
    # A prefill (0-10 ms), then decodes every 10 ms: 1 + 5 + 2 ms, then a 2 ms gap.
    steps = [_step(0, "prefill", 8, 1, 8, requests=2)]
    steps += [_step(10 + 10 * i, "decode", 5, 2, 5) for i in range(4)]
    return steps


def test_each_kind_gets_its_phases_shares_and_idle_share() -> None:
    summary = ts.summarize(_run())
    assert summary["steps"] == 5 and summary["wall_ms"] == pytest.approx(48.0)
    # Device busy 8 + 4 x 5 = 28 ms of 48.
    assert summary["device_idle_share"] == pytest.approx(1 - 28 / 48)
    decode = summary["kinds"]["decode"]
    assert decode["steps"] == 4 and decode["requests_p50"] == 4
    assert decode["phases"]["forward"]["p50_ms"] == pytest.approx(5.0)
    assert decode["phases"]["emit"]["share"] == pytest.approx(8 / 48)
    # Each decode follows a 2 ms gap (the previous step ended 8 ms after its start; the
    # prefill after 10 ms, so the first decode's gap is 0).
    assert decode["phases"]["gap"]["p50_ms"] == pytest.approx(2.0)
    assert decode["phases"]["gap"]["p90_ms"] == pytest.approx(2.0)
    assert decode["phases"]["gap"]["share"] == pytest.approx(6 / 48)
    # Decode spans: 8 ms + its gap; the device ran 5 of each.
    assert decode["device_idle_share"] == pytest.approx(1 - 20 / (4 * 8 + 6))
    assert summary["kinds"]["prefill"]["tokens_p50"] == 200
    # 200 prompt tokens in 8 ms of device time; 4 x 4 decode tokens in 20 ms.
    assert summary["kinds"]["prefill"]["device_tokens_per_s"] == pytest.approx(25_000)
    assert decode["tokens"] == 16 and decode["device_tokens_per_s"] == pytest.approx(800)
    assert "mixed" not in summary["kinds"]


def test_a_window_picks_its_steps_and_an_empty_one_says_so() -> None:
    steps = _run()
    assert [s["t_ns"] for s in ts.within(steps, 10 * MS, 30 * MS)] == [10 * MS, 20 * MS, 30 * MS]
    empty = ts.summarize(ts.within(steps, 100 * MS, 200 * MS))
    assert empty["steps"] == 0 and ts.headline(empty) == "no steps recorded"
    out = io.StringIO()
    ts.print_summary(empty, "w", out)
    assert "no steps recorded" in out.getvalue()


def test_the_file_reader_skips_headers_and_a_torn_last_line(tmp_path: Path) -> None:
    import json

    path = tmp_path / "t.jsonl"
    lines = [json.dumps({"step_timeline": 1, "pid": 1})]
    lines += [json.dumps(s) for s in reversed(_run())]
    path.write_text("\n".join(lines) + '\n{"t_ns": 9')
    assert [r["t_ns"] for r in ts.read_timeline(path)] == [s["t_ns"] for s in _run()]
    assert ts.main([str(path), "--from-ns", str(10 * MS), "--json", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text())["steps"] == 4
    assert ts.main([str(tmp_path / "missing.jsonl")]) == 2


def test_the_table_and_headline_name_the_largest_phases() -> None:
    summary = ts.summarize(_run())
    line = ts.headline(summary)
    assert line.startswith("5 steps, device idle 42%")
    assert "decode x4 (b4) step 10.00 ms: forward 5.00, emit 2.00, gap 2.00" in line
    out = io.StringIO()
    ts.print_summary(summary, "run", out)
    text = out.getvalue().splitlines()
    assert text[0].startswith("step timeline run: 5 steps in 0.05 s")
    assert text[4].split()[:4] == ["decode", "4", "4", "4"] and text[5].split()[0] == "share"


def test_each_http_row_gets_the_steps_of_its_timed_windows(tmp_path: Path) -> None:
    """compare's pytgi rows: the server's timeline file cut by each row's windows (every
    round's), attached once the server stopped; none without the timeline."""
    import json

    from pytgi_bench.compare.http_system import HttpSystem
    from pytgi_bench.compare.system_result import SystemResult

    http = HttpSystem(tmp_path / "model", tmp_path, None, [])
    assert "--step-timeline" in http._server.command()
    http.timeline_path.write_text("".join(json.dumps(s) + "\n" for s in _run()))
    single = SystemResult("pytgi-http-b1", "", extra={"timeline_windows_ns": [[0, 5 * MS]]})
    burst = SystemResult("pytgi-http", "", extra={
        "timeline_windows_ns": [[10 * MS, 20 * MS], [30 * MS, 31 * MS]]})
    http.attach_timelines([single, burst, None, SystemResult("hf-cb", "")])
    assert single.extra["timeline"]["kinds"].keys() == {"prefill"}
    assert burst.extra["timeline"]["steps"] == 3
    off = HttpSystem(tmp_path / "model", tmp_path / "off", None, [], timeline=False)
    assert "--step-timeline" not in off._server.command()
    quiet = SystemResult("pytgi-http", "", extra={"timeline_windows_ns": [[0, 1]]})
    off.attach_timelines([quiet])
    assert "timeline" not in quiet.extra
