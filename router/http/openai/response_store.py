"""The stored responses of `POST /v1/responses` (`store: true`, OpenAI's default): what
`GET /v1/responses/{id}` answers and what `previous_response_id` continues.

In memory, in this router process only: bounded by bytes (`--responses-store-bytes`), least
recently used first out. A response created on another replica, evicted, or created with
`store: false` is not here, and the routes say so with a 404. Each entry keeps the whole
conversation that led to it (as chat messages, its output included), so a chain never needs an
ancestor that may have been evicted: a continued conversation costs its full size again, which
the byte bound accounts for.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class StoredResponse:
    """A response object as GET returns it, and the conversation a follow-up continues: the
    chat messages of its input (instructions excluded, as OpenAI does not carry them over)
    and of its output."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    # The request's input as GET .../input_items lists it.
    input_items: list[dict[str, Any]] = field(default_factory=list)
    size: int = 0


def stored_size(response: dict[str, Any], conversation: list[dict[str, Any]],
                input_items: list[dict[str, Any]] | None = None) -> int:
    """The bytes an entry is charged: its JSON, the response, the conversation and the input
    items (Python's objects weigh more; the bound is on what the clients sent and the model
    wrote)."""
    text = json.dumps([response, conversation, input_items or []], ensure_ascii=False,
                      separators=(",", ":"))
    return len(text.encode())


class ResponseStore:
    """Responses by id, least recently used evicted past `max_bytes`; 0 stores nothing."""

    __slots__ = ("max_bytes", "_entries", "_bytes")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]],
            input_items: list[dict[str, Any]] | None = None) -> bool:
        """Stores (or replaces) the response under its id; False when it alone is over the
        bound (then it is not kept, and anything it replaced is gone too)."""
        key = str(response["id"])
        self.delete(key)
        items = input_items or []
        entry = StoredResponse(response, conversation, items,
                               stored_size(response, conversation, items))
        if entry.size > self.max_bytes:
            return False
        self._entries[key] = entry
        self._bytes += entry.size
        self._evict()
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, now the most recently used; None when absent."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True

    def _evict(self) -> None:
        while self._bytes > self.max_bytes and self._entries:
            _, oldest = self._entries.popitem(last=False)
            self._bytes -= oldest.size
