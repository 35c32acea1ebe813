"""A stored response's input items as `GET /v1/responses/{id}/input_items` lists them: the
request's `input` (already validated by responses_request.py) in the item form OpenAI answers,
each with an id, and OpenAI's cursor pagination (`order`, `limit`, `after`)."""

from __future__ import annotations

from typing import Any

from pytgi_router.core.errors import ValidationError
from pytgi_router.http.openai.response_output import new_id

# The id prefix of each item type, as OpenAI spells its ids.
PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
            "reasoning": "rs"}
MAX_LIMIT = 100


def listed_items(value: Any) -> list[dict[str, Any]]:
    """`input` (a string or validated items) as listed items: typed, with an id, a string
    content as one text part."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list):
        return []
    return [_listed(item) for item in value if isinstance(item, dict)]


def _listed(item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    out = {**item, "type": kind}
    out.setdefault("id", new_id(PREFIXES.get(kind, "item")))
    content = item.get("content")
    if kind == "message" and isinstance(content, str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": content}]
    if kind in ("message", "function_call_output"):
        out.setdefault("status", "completed")
    return out


def items_page(items: list[dict[str, Any]], query: dict[str, str]) -> dict[str, Any]:
    """One page of `items`: newest first unless `order=asc`, at most `limit` (1..100, default
    20), after the item whose id is `after`."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ValidationError('`order` must be "asc" or "desc"')
    limit = _limit(query.get("limit", "20"))
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [i["id"] for i in ordered]
        if after not in ids:
            raise ValidationError(f"`after` {after!r} is not an item of this response")
        ordered = ordered[ids.index(after) + 1:]
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > limit}


def _limit(text: str) -> int:
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise ValidationError(f"`limit` must be an integer in [1, {MAX_LIMIT}], got {text!r}")
    return limit
