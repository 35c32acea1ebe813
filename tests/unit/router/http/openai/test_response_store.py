"""response_store.py: responses by id within a byte bound, least recently used out first."""

from __future__ import annotations

from typing import Any

from pytgi_router.http.openai.response_store import ResponseStore, stored_size

CONVERSATION = [{"role": "user", "content": "x" * 100}]


def response(i: int) -> dict[str, Any]:
    return {"id": f"resp_{i}", "output": []}


def test_least_recently_used_leaves_first() -> None:
    one = stored_size(response(0), CONVERSATION)
    store = ResponseStore(3 * one)
    for i in range(3):
        assert store.put(response(i), CONVERSATION)
    assert store.get("resp_0") is not None  # now the most recent
    store.put(response(3), CONVERSATION)
    assert store.get("resp_1") is None
    assert [store.get(f"resp_{i}") is not None for i in (0, 2, 3)] == [True] * 3
    assert len(store) == 3 and store.used_bytes == 3 * one


def test_replacing_and_deleting_account_their_bytes() -> None:
    store = ResponseStore(10_000)
    store.put(response(0), CONVERSATION)
    store.put(response(0), [])
    assert len(store) == 1 and store.used_bytes == stored_size(response(0), [])
    assert store.delete("resp_0") and not store.delete("resp_0")
    assert store.used_bytes == 0


def test_an_entry_over_the_bound_is_not_kept() -> None:
    store = ResponseStore(stored_size(response(0), CONVERSATION) - 1)
    assert not store.put(response(0), CONVERSATION)
    assert store.get("resp_0") is None and store.used_bytes == 0
    assert not ResponseStore(0).put(response(1), [])
