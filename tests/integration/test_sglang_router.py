"""Two pytgi replicas (a shard and a router each) behind the real SGLang router
(`sglang-router launch`, the Rust gateway from PyPI): it discovers each worker's model through
/server_info and /model_info, lists the model by name, forwards TGI's /generate and OpenAI's
chat, and with `--policy cache_aware` sends requests that share a long prefix to the replica that
cached it — measured by the replicas' own cached-token metrics against `round_robin`'s."""

from __future__ import annotations

import json
import random
import signal
import time

import httpx
import pytest

from tests.integration.http_helpers import metric
from tests.integration.replica_gateways import (
    SGLANG,
    Replicas,
    RequestStream,
    binary_runs,
    replicas_fixture,  # noqa: F401 (the module's `replicas` fixture)
    sglang_gateway,
    wait_until,
)

pytestmark = pytest.mark.skipif(binary_runs(SGLANG, "launch") is not None,
                                reason=str(binary_runs(SGLANG, "launch")))


def test_worker_endpoints(replicas: Replicas) -> None:
    """The fields the gateway reads, and /flush_cache's refusal-free idle path."""
    url = replicas.urls[0]
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


def test_through_the_gateway(replicas: Replicas) -> None:
    gateway = sglang_gateway(replicas.urls, "cache_aware")
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
        ids = [t["id"] for t in httpx.post(f"{replicas.urls[0]}/tokenize",
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
    gateway = sglang_gateway(replicas, policy)
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


def test_cache_aware_routing_keeps_prefixes_on_their_replica(replicas: Replicas) -> None:
    """Five long prefixes, four requests each, interleaved: cache_aware sends each prefix's
    requests to one replica (one miss per prefix), round_robin alternates, so that each prefix
    reaches both (five being odd) and misses once on each."""
    rng = random.Random(0)
    words = ["river", "stone", "cloud", "amber", "north", "quiet", "lamp", "gate", "field"]
    prefixes = [" ".join(rng.choice(words) for _ in range(60)) for _ in range(5)]
    prompts = [f"{prefixes[i % 5]} question {i}?" for i in range(20)]
    affine = _cached_share(replicas.urls, "cache_aware", prompts)
    spread = _cached_share(replicas.urls, "round_robin", prompts)
    assert affine >= 0.6, (affine, spread)
    assert affine > spread + 0.1, (affine, spread)


def test_rolling_restart_under_a_stream_of_requests_fails_none(replicas: Replicas) -> None:
    """SIGTERM → /health 503 for the drain grace while the replica still serves → the gateway's
    health check takes it out → it finishes what it holds and exits 0 → restarted on its port →
    back in rotation; two clients send completions throughout and every one gets a 200, with the
    gateway's retries off."""
    url = replicas.urls[0]
    # Retries off: the gateway would otherwise resend a request the draining replica refused
    # to the other one, and the test would pass without the drain grace (it does).
    gateway = sglang_gateway(replicas.urls, "round_robin", "--disable-retries")
    try:
        stream = RequestStream(gateway.url, clients=2)
        try:
            stream.wait_for(6)
            replicas.routers[0].signal(signal.SIGTERM)
            wait_until(lambda: url not in gateway.healthy(), 10, "the gateway to drop replica 0")
            assert replicas.routers[0].wait(60) == 0
            replicas.restart(0)
            wait_until(gateway.all_healthy, 30, "replica 0 back in the gateway")
            failed = [o for o in stream.outcomes if o.status != 200]
            assert not failed, failed[:3]
            wait_until(lambda: metric(url, "tgi_request_success") >= 3, 30,
                       "requests on the restarted replica")
        finally:
            outcomes = stream.stop()
    finally:
        gateway.stop()
    failed = [o for o in outcomes if o.status != 200]
    assert not failed, failed[:3]
    assert len(outcomes) >= 12


def test_sigkill_loses_only_the_requests_on_the_killed_replica(replicas: Replicas) -> None:
    """A replica killed outright: the requests it held fail (at most one per client), every
    request sent after the kill succeeds on the other replica (the gateway retries a refused
    connection elsewhere, and its health check takes the dead one out within a second). Last in
    the module: replica 0 stays dead."""
    gateway = sglang_gateway(replicas.urls, "round_robin")
    try:
        stream = RequestStream(gateway.url, clients=2)
        try:
            stream.wait_for(6)
            replicas.routers[0].kill()
            # After the process is gone (kill() waits for it): a request sent while it was still
            # dying may have been in flight on it, and is one of those allowed to fail.
            killed_at = time.monotonic()
            wait_until(lambda: replicas.urls[0] not in gateway.healthy(), 10,
                       "the gateway to drop the killed replica")
            after = len(stream.outcomes)
            stream.wait_for(after + 10)
        finally:
            outcomes = stream.stop()
    finally:
        gateway.stop()
    failed = [o for o in outcomes if o.status != 200]
    assert len(failed) <= 2, failed
    assert all(o.sent < killed_at for o in failed), failed
    assert sum(o.sent > killed_at for o in outcomes) >= 10
