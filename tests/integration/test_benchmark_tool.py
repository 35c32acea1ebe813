"""`pytgi-benchmark` against a real pytgi (shard process + router process, tiny Llama): tiny runs
whose numbers must agree with each other, and loud failures on dead endpoints."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pytgi_bench.cli import main
from tests.router_process import RouterProcess
from tests.shard_process import ShardProcesses, free_port, start_shards

BENCH = str(Path(sys.executable).with_name("pytgi-benchmark"))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def shards(tiny_model: Callable[..., Path]) -> Iterator[ShardProcesses]:
    with start_shards(tiny_model("llama")) as s:
        yield s


@pytest.fixture(scope="module")
def url(shards: ShardProcesses, tiny_model: Callable[..., Path]) -> Iterator[str]:
    with RouterProcess(shards.urls[0], tiny_model("llama"), "--max-input-tokens", "100",
                       "--max-total-tokens", "200") as router:
        yield router.url


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BENCH, *args], capture_output=True, text=True, timeout=120)


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


# First in the file: it warms up and clears the shard before the router (started by the `url`
# fixture of the later tests) takes the shard over.
def test_shards_benchmark_reports_consistent_prefill_and_decode(
    shards: ShardProcesses, tmp_path: Path
) -> None:
    out = tmp_path / "shards.json"
    done = bench("shards", "--master", shards.urls[0], "-b", "1", "-b", "3", "-s", "6",
                 "-d", "4", "-r", "2", "-w", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "Decode (token)" in done.stdout
    data = load(out)
    assert [r["batch_size"] for r in data["results"]] == [1, 3]
    for r in data["results"]:
        # Prefill makes the first token; Decode runs until each request has 4.
        assert r["decode_steps"] == 3
        prefill, decode = r["prefill_latency"], r["decode_total_latency"]
        assert prefill["count"] == 2 and 0 < prefill["min_ms"] <= prefill["mean_ms"]
        tput = r["prefill_throughput"]
        assert tput["max"] == pytest.approx(r["batch_size"] * 6 / (prefill["min_ms"] / 1000))
        assert r["decode_token_latency"]["mean_ms"] == pytest.approx(decode["mean_ms"] / 3)
        assert 0 < r["decode_step_shard_ms"] <= r["decode_token_latency"]["max_ms"]
    assert out.with_suffix(".png").read_bytes().startswith(PNG_MAGIC)


def test_tgi_run_numbers_agree_with_each_other(url: str, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    done = bench("run", "--url", url, "-n", "12", "-c", "4", "--input-len", "8:24",
                 "--output-len", "10", "--goodput", "ttft:600000", "e2el:600000",
                 "--out", str(out), "--no-progress", "--no-plots")
    assert done.returncode == 0, done.stderr
    assert "Output token throughput" in done.stdout
    data = load(out)
    assert data["workload"] == {"requests": 12, "input_lengths_exact": True,
                                "length_mismatches": 0}
    (run,) = data["runs"]
    s, requests = run["summary"], run["requests"]
    assert (s["completed"], s["failed"], len(requests)) == (12, 0, 12)
    assert 1 <= s["max_concurrency"] <= 4
    shortfall = 0
    for r in requests:
        assert 8 <= r["input_tokens"] < 24
        # One SSE event per token: the streamed count matches details.generated_tokens.
        assert r["output_tokens"] == len(r["itl_ms"]) + 1
        assert 0 < r["ttft_ms"] <= r["e2el_ms"]
        assert r["ttft_ms"] + sum(r["itl_ms"]) <= r["e2el_ms"] + 1.0
        if r["finish_reason"] == "length":
            assert r["output_tokens"] == 10
        shortfall += 10 - r["output_tokens"]
    assert s["total_output_tokens"] == sum(r["output_tokens"] for r in requests)
    assert s["total_output_tokens"] == 12 * 10 - shortfall
    assert s["requested_output_tokens"] == 12 * 10
    assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / s["duration_s"])
    assert s["request_throughput"] == pytest.approx(12 / s["duration_s"])
    assert s["goodput"] == pytest.approx(s["request_throughput"])
    for metric in ("ttft", "tpot", "itl", "e2el"):
        stats = s[metric]
        assert 0 < stats["min_ms"] <= stats["p50_ms"] <= stats["p90_ms"] <= stats["p99_ms"]
        assert stats["p99_ms"] <= stats["max_ms"]
    assert s["ttft"]["max_ms"] <= s["e2el"]["max_ms"]
    assert not out.with_suffix(".cdf.png").exists()


def test_openai_sweep_counts_usage_tokens_through_httpx(url: str, tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    done = bench("run", "--url", url, "--api", "openai-completions", "-n", "3",
                 "--sweep-concurrency", "1,3", "--input-len", "12", "--output-len", "4",
                 "--warmup", "0", "--out", str(out), "--no-progress", "--http-client", "httpx")
    assert done.returncode == 0, done.stderr
    runs = load(out)["runs"]
    assert [r["concurrency"] for r in runs] == [1, 3]
    assert runs[0]["summary"]["max_concurrency"] == 1
    for run in runs:
        assert run["summary"]["completed"] == 3
        for r in run["requests"]:
            assert r["input_tokens"] == 12 and 1 <= r["output_tokens"] <= 4
    for plot in (".cdf.png", ".sweep.png"):
        assert out.with_suffix(plot).read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize("client", ["raw", "httpx"])
def test_request_errors_are_counted_with_their_message(url: str, client: str) -> None:
    # 50 input tokens + 190 new ones exceed --max-total-tokens 200: every request gets a 422.
    done = bench("run", "--url", url, "-n", "3", "--input-len", "50", "--output-len", "190",
                 "--warmup", "0", "--no-progress", "--http-client", client)
    assert done.returncode == 1
    assert "Failed requests:" in done.stdout
    assert "error x3: HTTP 422: Input validation error: `inputs` tokens + `max_new_tokens`" in (
        done.stdout
    )
    assert "every request failed: HTTP 422" in done.stderr


def test_dead_endpoints_fail_loudly(capsys: pytest.CaptureFixture[str]) -> None:
    # In-process calls of the console script's main(): the exit code is its return value.
    dead = f"http://127.0.0.1:{free_port()}"
    assert main(["run", "--url", dead, "-n", "2", "--no-progress"]) == 2
    assert f"cannot reach {dead}" in capsys.readouterr().err
    missing = "/tmp/pytgi-no-such-socket-0"
    assert main(["shards", "--master-shard-uds-path", missing, "-r", "1"]) == 2
    assert f"no shard socket at {missing}" in capsys.readouterr().err
    tcp = f"127.0.0.1:{free_port()}"
    assert main(["shards", "--master", tcp, "-r", "1", "--connect-timeout", "1"]) == 2
    assert "cannot connect to the shards" in capsys.readouterr().err


def test_open_loop_arrivals_follow_the_seeded_poisson_schedule(url: str, tmp_path: Path) -> None:
    out = tmp_path / "poisson.json"
    done = bench("run", "--url", url, "-n", "8", "--request-rate", "20", "--seed", "7",
                 "--input-len", "8", "--output-len", "3", "--warmup", "0", "--out", str(out),
                 "--no-plots", "--no-progress")
    assert done.returncode == 0, done.stderr
    starts = [r["start_s"] for r in load(out)["runs"][0]["requests"]]
    rng, arrival, expected = random.Random(7), 0.0, []
    for _ in range(8):
        arrival += rng.expovariate(20)
        expected.append(arrival)
    # The client sleeps until each arrival; a busy machine can only make it late, by little.
    for got, want in zip(starts, expected, strict=True):
        assert want - 0.002 <= got <= want + 0.25


def test_duration_mode_keeps_the_loop_closed(url: str, tmp_path: Path) -> None:
    out = tmp_path / "duration.json"
    done = bench("run", "--url", url, "--duration", "1", "-c", "2", "-n", "4",
                 "--input-len", "8", "--output-len", "4", "--warmup", "0", "--out", str(out),
                 "--no-plots", "--no-progress")
    assert done.returncode == 0, done.stderr
    s = load(out)["runs"][0]["summary"]
    assert s["completed"] >= 2 and s["failed"] == 0 and s["max_concurrency"] == 2
    assert s["duration_s"] >= 1.0
