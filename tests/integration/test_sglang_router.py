"""Two pytgi replicas (a shard and a router each) behind the real SGLang router
(`sglang-router launch`, the Rust gateway from PyPI): it discovers each worker's model through
/server_info and /model_info, lists the model by name, forwards TGI's /generate and OpenAI's
chat, and with `--policy cache_aware` sends requests that share a long prefix to the replica that
cached it — measured by the replicas' own cached-token metrics against `round_robin`'s."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.http_helpers import metric
from tests.router_process import RouterProcess
from tests.shard_process import free_port, start_shards

GATEWAY = shutil.which("sglang-router", path=str(Path(sys.executable).parent))


def _gateway_runs() -> str | None:
    """Why the gateway cannot run here (None: it can)."""
    if GATEWAY is None:
        return "sglang-router is not installed (pip install 'pytgi[test]')"
    try:
        subprocess.run([GATEWAY, "launch", "--help"], capture_output=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as err:
        return f"the sglang-router binary does not run here: {err}"
    return None


pytestmark = pytest.mark.skipif(_gateway_runs() is not None, reason=str(_gateway_runs()))


class Gateway:
    """`sglang-router launch` in front of `workers`, until stop()."""

    def __init__(self, workers: list[str], policy: str) -> None:
        assert GATEWAY is not None
        self.url = f"http://127.0.0.1:{free_port()}"
        self.count = len(workers)
        port = self.url.rsplit(":", 1)[1]
        self.proc = subprocess.Popen(
            [GATEWAY, "launch", "--host", "127.0.0.1", "--port", port, "--policy", policy,
             "--worker-urls", *workers, "--prometheus-port", str(free_port()),
             "--health-check-interval-secs", "1", "--log-level", "warn"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        deadline = time.monotonic() + 60
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"sglang-router did not start:\n{self.output()}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        """Every worker registered (the gateway adds them in the background, one at a time)."""
        try:
            listed = httpx.get(f"{self.url}/workers", timeout=5)
        except httpx.HTTPError:
            return False
        if listed.status_code != 200:
            return False
        workers = listed.json().get("workers") or []
        return len(workers) == self.count and all(w.get("is_healthy", True) for w in workers)

    def output(self) -> str:
        if self.proc.poll() is None:
            return ""
        assert self.proc.stdout is not None
        return self.proc.stdout.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def replicas(model: Path) -> Iterator[list[str]]:
    """Two shard + router pairs serving the tiny model under one served name."""
    with start_shards(model) as one, start_shards(model) as two:
        flags = ("--served-model-name", "tiny", "--max-input-tokens", "400",
                 "--max-total-tokens", "420")
        with RouterProcess(one.urls[0], model, *flags) as a, \
                RouterProcess(two.urls[0], model, *flags) as b:
            yield [a.url, b.url]


def test_worker_endpoints(replicas: list[str]) -> None:
    """The fields the gateway reads, and /flush_cache's refusal-free idle path."""
    url = replicas[0]
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(f"{url}{path}").json()
        assert info["served_model_name"] == "tiny" and info["is_generation"] is True
        assert info["max_total_num_tokens"] > 0 and info["page_size"] > 0
        assert info["architectures"] == ["LlamaForCausalLM"]
    model = httpx.get(f"{url}/model_info").json()
    assert model == httpx.get(f"{url}/get_model_info").json()
    assert model["model_type"] == "llama" and model["tokenizer_path"]
    load = httpx.get(f"{url}/get_load").json()
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    assert httpx.post(f"{url}/flush_cache").status_code == 200


def test_through_the_gateway(replicas: list[str]) -> None:
    gateway = Gateway(replicas, "cache_aware")
    try:
        g = gateway.url
        assert [m["id"] for m in httpx.get(f"{g}/v1/models").json()["data"]] == ["tiny"]
        chat = httpx.post(f"{g}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "max_tokens": 5,
            "messages": [{"role": "user", "content": "Hello"}]})
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["role"] == "assistant"
        # /generate: the gateway forwards SGLang's body (it drops TGI's `inputs`).
        body = {"text": "Hello world", "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
        answer = httpx.post(f"{g}/generate", timeout=60, json=body)
        assert answer.status_code == 200, answer.text
        meta = answer.json()["meta_info"]
        assert meta["completion_tokens"] == 5 and meta["finish_reason"]["type"] == "length"
        with httpx.stream("POST", f"{g}/generate", timeout=60,
                          json={**body, "stream": True}) as streamed:
            lines = [ln for ln in streamed.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) == 6, lines
        assert json.loads(lines[-2][6:])["text"] == answer.json()["text"]
        ids = [t["id"] for t in httpx.post(f"{replicas[0]}/tokenize",
                                            json={"inputs": "Hello world"}).json()]
        by_ids = httpx.post(f"{g}/generate", timeout=60, json={
            "input_ids": ids, "sampling_params": body["sampling_params"]})
        assert by_ids.status_code == 200, by_ids.text
        assert by_ids.json()["text"] == answer.json()["text"]
        assert by_ids.json()["meta_info"]["prompt_tokens"] == len(ids)
        tgi = httpx.post(f"{g}/generate", timeout=60, json={"inputs": "Hello world"})
        assert tgi.status_code == 422 and "inputs" in tgi.json()["error"], tgi.text
    finally:
        gateway.stop()


def _cached_share(replicas: list[str], policy: str, prompts: list[str]) -> float:
    """Prompt tokens the replicas found cached / prompt tokens, for `prompts` sent in turn
    through a gateway with `policy`, from cold prefix caches."""
    for url in replicas:
        assert httpx.post(f"{url}/flush_cache").status_code == 200
    before = [(metric(u, "pytgi_request_cached_tokens_sum"),
               metric(u, "tgi_request_input_length_sum")) for u in replicas]
    gateway = Gateway(replicas, policy)
    try:
        for prompt in prompts:
            r = httpx.post(f"{gateway.url}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200, r.text
    finally:
        gateway.stop()
    cached = sum(metric(u, "pytgi_request_cached_tokens_sum") - c
                 for u, (c, _) in zip(replicas, before, strict=True))
    prompt_tokens = sum(metric(u, "tgi_request_input_length_sum") - t
                        for u, (_, t) in zip(replicas, before, strict=True))
    return cached / prompt_tokens


def test_cache_aware_routing_keeps_prefixes_on_their_replica(replicas: list[str]) -> None:
    """Five long prefixes, four requests each, interleaved: cache_aware sends each prefix's
    requests to one replica (one miss per prefix), round_robin alternates, so that each prefix
    reaches both (five being odd) and misses once on each."""
    rng = random.Random(0)
    words = ["river", "stone", "cloud", "amber", "north", "quiet", "lamp", "gate", "field"]
    prefixes = [" ".join(rng.choice(words) for _ in range(60)) for _ in range(5)]
    prompts = [f"{prefixes[i % 5]} question {i}?" for i in range(20)]
    affine = _cached_share(replicas, "cache_aware", prompts)
    spread = _cached_share(replicas, "round_robin", prompts)
    assert affine >= 0.6, (affine, spread)
    assert affine > spread + 0.1, (affine, spread)
