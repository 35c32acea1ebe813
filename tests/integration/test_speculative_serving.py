"""--speculate over real HTTP: one shard process of the tiny Llama drafting up to 3 tokens per
step (n-gram) behind a router that prefills in chunks of 16 tokens, against the same server
without --speculate (the reference).

Greedy requests must give exactly the reference's tokens: on prompts that repeat themselves
(drafts kept, as /metrics shows) and ones that do not, with a prompt in chunks, a prefix-cache
hit, a stop sequence and every max_new_tokens. Seeded sampling requests (with top tokens) give
the reference's tokens too, and every sequence of a best_of request is the one its reported seed
gives on the reference.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.speculative_cases import (
    PLAIN,
    REPEATING,
    chunked_server,
    generate,
    ids,
    metric,
)


@pytest.fixture(scope="module")
def url(model: Path) -> Iterator[str]:
    with chunked_server(model, ["--speculate", "3"]) as served:
        yield served


@pytest.fixture(scope="module")
def plain(model: Path) -> Iterator[str]:
    """The same server without --speculate."""
    with chunked_server(model) as served:
        yield served


def test_info_reports_speculate(url: str) -> None:
    assert httpx.get(f"{url}/info", timeout=30).json()["speculate"] == 3


def test_greedy_tokens_equal_the_plain_rows_and_drafts_are_kept(url: str, plain: str) -> None:
    for prompt in (REPEATING, PLAIN):
        expected = ids(generate(plain, prompt, max_new_tokens=40))
        got = generate(url, prompt, max_new_tokens=40)
        assert ids(got) == expected
        # Again: the prompt's blocks now come from the prefix cache.
        assert ids(generate(url, prompt, max_new_tokens=40)) == expected
    assert metric(url, "pytgi_speculative_accepted_tokens") > 0
    assert metric(url, "pytgi_speculative_drafted_tokens") >= metric(
        url, "pytgi_speculative_accepted_tokens")


def test_streamed_tokens_one_event_each(url: str, plain: str) -> None:
    expected = ids(generate(plain, REPEATING, max_new_tokens=24))
    body = {"inputs": REPEATING, "parameters": {"max_new_tokens": 24, "details": True}}
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert [e["token"]["id"] for e in events] == expected
    assert events[-1]["details"]["finish_reason"] == "length"


def test_every_max_new_tokens_and_a_stop_sequence_end_where_the_plain_run_does(
    url: str, plain: str,
) -> None:
    full = generate(plain, REPEATING, max_new_tokens=30)
    tokens = ids(full)
    for max_new in (1, 2, 3, 5, 8, 13):
        got = generate(url, REPEATING, max_new_tokens=max_new)
        assert ids(got) == tokens[:max_new]
        assert got["details"]["finish_reason"] == "length"
    # A stop sequence that first appears late in the text.
    text = full["generated_text"]
    stop = next(text[:end][-length:] for end in range(len(text) // 2, len(text))
                for length in range(2, end) if text[:end][-length:] not in text[: end - 1])
    expected = generate(plain, REPEATING, max_new_tokens=30, stop=[stop])
    got = generate(url, REPEATING, max_new_tokens=30, stop=[stop])
    assert got["details"]["finish_reason"] == "stop_sequence"
    assert ids(got) == ids(expected)
    assert got["generated_text"] == expected["generated_text"]


def test_a_seeded_sampling_request_gives_the_same_text_twice(url: str) -> None:
    params = {"max_new_tokens": 20, "do_sample": True, "seed": 11, "temperature": 0.8}
    first = generate(url, REPEATING, **params)
    assert generate(url, REPEATING, **params)["generated_text"] == first["generated_text"]


def test_seeded_sampling_gives_the_reference_tokens_and_top_tokens(url: str, plain: str) -> None:
    before = metric(url, "pytgi_speculative_accepted_tokens")
    for seed in (1, 2, 3):
        # The random model's distributions are wide: cooled, so that drafts are kept.
        params = {"max_new_tokens": 24, "do_sample": True, "seed": seed, "temperature": 0.1,
                  "top_n_tokens": 2}
        got, expected = generate(url, REPEATING, **params), generate(plain, REPEATING, **params)
        assert ids(got) == ids(expected)
        assert got["details"]["seed"] == seed
        tops = [[[t["id"] for t in step] for step in a["details"]["top_tokens"]]
                for a in (got, expected)]
        assert tops[0] == tops[1] and len(tops[0]) == 24
        for a, b in zip(got["details"]["tokens"], expected["details"]["tokens"], strict=True):
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
    assert metric(url, "pytgi_speculative_accepted_tokens") > before, "sampling rows drafted"


def test_every_best_of_sequence_is_what_its_seed_gives_without_drafts(
    url: str, plain: str
) -> None:
    params = {"max_new_tokens": 16, "do_sample": True, "temperature": 0.3, "best_of": 2}
    got = generate(url, REPEATING, **params)["details"]
    sequences = [got, *got["best_of_sequences"]]
    assert len(sequences) == 2
    for sequence in sequences:
        alone = generate(plain, REPEATING, max_new_tokens=16, do_sample=True, temperature=0.3,
                         seed=sequence["seed"])
        # 16 tokens unless the seed samples EOS first: then both stop there.
        assert sequence["generated_tokens"] == len(ids(alone))
        assert sequence["finish_reason"] == alone["details"]["finish_reason"]
        assert [t["id"] for t in sequence["tokens"]] == ids(alone)
