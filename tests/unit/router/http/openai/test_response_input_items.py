"""response_input_items.py: a response's input as OpenAI lists it (typed items with ids, text
parts) and its cursor pagination."""

from __future__ import annotations

import pytest

from pytgi_router.core.errors import ValidationError
from pytgi_router.http.openai.response_input_items import items_page, listed_items


def test_string_and_items_become_listed_items() -> None:
    [one] = listed_items("Hi")
    assert one["type"] == "message" and one["id"].startswith("msg_")
    assert one["content"] == [{"type": "input_text", "text": "Hi"}]
    items = listed_items([{"role": "assistant", "content": "A"},
                          {"type": "function_call", "call_id": "c", "name": "f",
                           "arguments": "{}", "id": "fc_mine"}])
    assert items[0]["content"] == [{"type": "output_text", "text": "A"}]
    assert items[1]["id"] == "fc_mine"


def test_pages_newest_first_with_a_cursor() -> None:
    items = [{"id": f"i{n}"} for n in range(5)]
    page = items_page(items, {"limit": "2"})
    assert [i["id"] for i in page["data"]] == ["i4", "i3"] and page["has_more"]
    rest = items_page(items, {"limit": "2", "after": page["last_id"]})
    assert [i["id"] for i in rest["data"]] == ["i2", "i1"]
    last = items_page(items, {"order": "asc", "after": "i3"})
    assert [i["id"] for i in last["data"]] == ["i4"] and not last["has_more"]
    assert items_page([], {}) == {"object": "list", "data": [], "first_id": None,
                                  "last_id": None, "has_more": False}


@pytest.mark.parametrize("query", [{"limit": "0"}, {"limit": "x"}, {"order": "up"},
                                   {"after": "nope"}])
def test_bad_queries_are_refused(query: dict[str, str]) -> None:
    with pytest.raises(ValidationError):
        items_page([{"id": "a"}], query)
