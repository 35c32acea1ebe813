"""Live LoRA over real HTTP: one shard of the tiny Llama started with no adapter,
--enable-lora-runtime-updates, --max-loras 2 and --max-lora-rank 8, behind a router with
--api-key.

vLLM's routes load an adapter (then it answers what transformers gives on the merged weights),
refuse a second load of its name (400), a missing path (404) and an adapter that does not fit
(400 naming why), unload it (then adapter_id is the unknown-adapter 422, and a second unload 404);
both routes need the API key. Four adapters under two device slots, requested at once, each give
their own answer (a step mixing three would be refused by the shard: the router's cap holds). An
adapter loaded again under the same name, with other weights, never reuses the old one's cached
KV. The per-adapter metrics and vLLM's lora_requests_info gauge are there.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from pytgi_router.core.lora_adapters import AdapterTable
from pytgi_router.core.lora_updates import replay_loads
from pytgi_router.core.shard_client import ShardClient
from tests.hf_reference import hf_greedy
from tests.lora_adapters import merged_model, write_adapter
from tests.router_process import RouterProcess
from tests.shard_process import start_shards

PROMPT = "the quick brown fox jumps over the lazy dog and then it runs far away into the woods"
NEW = 6
KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAMES = ("a", "b", "c", "d")


@pytest.fixture(scope="module")
def adapters(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_live")
    out = {name: write_adapter(root / name, model, rank=4, alpha=8, seed=20 + i)
           for i, name in enumerate(NAMES)}
    out["wide"] = write_adapter(root / "wide", model, rank=16, alpha=16, seed=29)
    return out


@pytest.fixture(scope="module")
def servers(model: Path) -> Iterator[tuple[str, str]]:
    """(the router's URL, rank 0's address)."""
    flags = ["--enable-lora-runtime-updates", "--max-loras", "2", "--max-lora-rank", "8"]
    with start_shards(model, extra_args=flags) as shards, RouterProcess(
        shards.urls[0], model, "--api-key", KEY
    ) as router:
        yield router.url, shards.urls[0]


@pytest.fixture(scope="module")
def url(servers: tuple[str, str]) -> str:
    return servers[0]


@pytest.fixture(scope="module")
def prompt_ids(url: str) -> list[int]:
    r = post(url, "generate", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 1, "decoder_input_details": True, "details": True}})
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["prefill"]]


@pytest.fixture(scope="module")
def expected(model: Path, adapters: dict[str, Path], prompt_ids: list[int],
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    root = tmp_path_factory.mktemp("merged")
    out = {name: hf_greedy(merged_model(root / name, model, adapters[name]), prompt_ids, NEW,
                           ignore_eos=True)[0] for name in NAMES}
    assert len({tuple(t) for t in out.values()}) == len(NAMES)
    return out


def post(url: str, route: str, body: dict[str, Any], auth: bool = True) -> httpx.Response:
    return httpx.post(f"{url}/{route}", json=body, headers=AUTH if auth else None, timeout=120)


def load(url: str, name: str, path: Path | str) -> httpx.Response:
    return post(url, "v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def unload(url: str, name: str) -> httpx.Response:
    return post(url, "v1/unload_lora_adapter", {"lora_name": name})


def generate(url: str, adapter: str | None) -> httpx.Response:
    params: dict[str, Any] = {"max_new_tokens": NEW, "details": True, "ignore_eos": True}
    if adapter is not None:
        params["adapter_id"] = adapter
    return post(url, "generate", {"inputs": PROMPT, "parameters": params})


def tokens(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


def metric(url: str, prefix: str) -> list[str]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return [line for line in text.splitlines() if line.startswith(prefix)]


def test_load_use_unload(url: str, adapters: dict[str, Path],
                         expected: dict[str, list[int]]) -> None:
    body = {"lora_name": "a", "lora_path": str(adapters["a"])}
    assert post(url, "v1/load_lora_adapter", body, auth=False).status_code == 401
    r = load(url, "a", adapters["a"])
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'a' added successfully.")
    info = httpx.get(f"{url}/info", headers=AUTH, timeout=30).json()
    assert (info["lora_adapters"], info["max_loras"], info["lora_runtime_updates"]) == (
        ["a"], 2, True)
    models = httpx.get(f"{url}/v1/models", headers=AUTH, timeout=30).json()["data"]
    assert [m["id"] for m in models[1:]] == ["a"]
    assert tokens(generate(url, "a")) == expected["a"]
    assert metric(url, 'pytgi_lora_requests_total{adapter="a"}') == [
        'pytgi_lora_requests_total{adapter="a"} 1.0']
    assert metric(url, 'pytgi_lora_generated_tokens_total{adapter="a"}') == [
        f'pytgi_lora_generated_tokens_total{{adapter="a"}} {float(NEW)}']

    again = load(url, "a", adapters["b"])
    assert again.status_code == 400
    assert again.json()["error"]["message"] == "The lora adapter 'a' has already been loaded."

    assert post(url, "v1/unload_lora_adapter", {"lora_name": "a"}, auth=False).status_code == 401
    r = unload(url, "a")
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'a' removed successfully.")
    refused = generate(url, "a")
    assert refused.status_code == 422 and "'a' is not a loaded adapter" in refused.json()["error"]
    gone = unload(url, "a")
    assert gone.status_code == 404
    assert gone.json()["error"] == {"message": "The lora adapter 'a' cannot be found.",
                                    "type": "NotFoundError", "param": None, "code": 404}
    assert metric(url, 'pytgi_lora_requests_total{adapter="a"}') == []


def test_bad_loads_name_the_reason(url: str, adapters: dict[str, Path], tmp_path: Path) -> None:
    missing = load(url, "x", tmp_path / "nowhere")
    assert missing.status_code == 404 and "does not exist" in missing.json()["error"]["message"]
    wide = load(url, "wide", adapters["wide"])
    assert wide.status_code == 400
    assert "rank r=16 exceeds --max-lora-rank 8" in wide.json()["error"]["message"]
    assert load(url, "", adapters["b"]).status_code == 400
    assert "x" not in served(url)


def test_four_adapters_under_two_slots_each_get_their_own_answer(
    url: str, adapters: dict[str, Path], expected: dict[str, list[int]]
) -> None:
    for name in NAMES:
        assert load(url, name, adapters[name]).status_code == 200
    try:
        cases = [name for name in NAMES for _ in range(2)]
        with ThreadPoolExecutor(len(cases)) as pool:
            answers = list(pool.map(lambda name: generate(url, name), cases))
        for name, answer in zip(cases, answers, strict=True):
            assert tokens(answer) == expected[name], name
        (line,) = metric(url, "vllm:lora_requests_info{")
        assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line
        for name in NAMES:
            assert metric(url, f'pytgi_lora_requests_total{{adapter="{name}"}}')
    finally:
        for name in NAMES:
            unload(url, name)


def test_a_reloaded_name_never_reuses_the_old_adapters_cached_blocks(
    servers: tuple[str, str], adapters: dict[str, Path], expected: dict[str, list[int]]
) -> None:
    url, shard = servers
    assert load(url, "same", adapters["c"]).status_code == 200
    index = wire_index(shard, "same")
    assert tokens(generate(url, "same")) == expected["c"]
    assert tokens(generate(url, "same")) == expected["c"]  # its own blocks: reused
    cached = cached_tokens(url)
    assert unload(url, "same").status_code == 200
    time.sleep(0.5)  # the shards free its index: the new load takes the same one
    assert load(url, "same", adapters["d"]).status_code == 200
    # Same name, same wire index: only the load key tells the two apart.
    assert wire_index(shard, "same") == index
    assert tokens(generate(url, "same")) == expected["d"]
    assert cached_tokens(url) == cached  # nothing of "c" was found for the new "same"
    unload(url, "same")


def served(url: str) -> list[str]:
    """/info's adapters, by wire index."""
    return list(httpx.get(f"{url}/info", headers=AUTH, timeout=30).json()["lora_adapters"])


def wire_index(shard: str, name: str) -> int:
    """The wire index the shards hold `name` at (their Info lists free indices as "")."""
    async def ask() -> list[str]:
        client = await ShardClient.connect(shard)
        try:
            return list((await client.info()).lora_adapters)
        finally:
            await client.close()
    return asyncio.run(ask()).index(name) + 1


def cached_tokens(url: str) -> float:
    (line,) = metric(url, "pytgi_request_cached_tokens_sum ")
    return float(line.split()[1])


def test_requests_in_flight_finish_after_their_adapter_is_unloaded(
    url: str, adapters: dict[str, Path], expected: dict[str, list[int]]
) -> None:
    """A stream under the adapter is under way when it is unloaded: it ends with every token
    it would have had; a new request for it is refused meanwhile; an adapter loaded meanwhile
    (another index: the old one is not free yet) answers with its own weights."""
    assert load(url, "flight", adapters["a"]).status_code == 200
    params = {"max_new_tokens": 48, "details": True, "ignore_eos": True, "adapter_id": "flight"}
    reference = tokens(post(url, "generate", {"inputs": PROMPT, "parameters": params}))
    streamed: list[int] = []
    body = {"inputs": PROMPT, "parameters": params}
    with httpx.stream("POST", f"{url}/generate_stream", json=body, headers=AUTH,
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            streamed.append(json.loads(line[5:])["token"]["id"])
            if len(streamed) == 1:
                assert unload(url, "flight").status_code == 200
                assert generate(url, "flight").status_code == 422
                assert load(url, "late", adapters["b"]).status_code == 200
                assert tokens(generate(url, "late")) == expected["b"]
    assert streamed == reference
    unload(url, "late")


def test_a_restarted_shard_group_gets_the_live_adapters_back(
    servers: tuple[str, str], adapters: dict[str, Path], expected: dict[str, list[int]]
) -> None:
    """What the router does after a shard-group restart (Infer.reconnect): the shards, which
    lost the live loads (modelled by unloading it on them), get them again at their indices."""
    url, shard = servers
    assert load(url, "kept", adapters["c"]).status_code == 200
    ref = AdapterTable()

    async def lose_then_replay() -> list[str]:
        client = await ShardClient.connect(shard)
        try:
            names = list((await client.info()).lora_adapters)
            index = names.index("kept") + 1
            await client.unload_adapter(index)
            assert "kept" not in (await client.info()).lora_adapters
            ref.add("kept", index, str(adapters["c"]))
            await replay_loads(client, ref, [], None)
            return list((await client.info()).lora_adapters)
        finally:
            await client.close()

    after = asyncio.run(lose_then_replay())
    assert "kept" in after and after.index("kept") + 1 == ref.get("kept").index  # type: ignore[union-attr]
    assert tokens(generate(url, "kept")) == expected["c"]
    unload(url, "kept")
