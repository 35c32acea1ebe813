"""A minimal server-sent-events splitter working on raw bytes.

Hot path of the load generator: every streamed token passes through `feed`, so it splits bytes
without decoding to str and without per-field parsing; only `data:` lines matter to TGI and
OpenAI streams (keep-alive comments and `event:` lines are skipped).
"""

from __future__ import annotations


class SSEDecoder:
    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """The `data:` payloads completed by `chunk`, in order (a partial line waits)."""
        lines = (self._pending + chunk).split(b"\n") if self._pending else chunk.split(b"\n")
        self._pending = lines.pop()
        return [line[5:].strip() for line in lines if line.startswith(b"data:")]

    def close(self) -> list[bytes]:
        """Payload of a last line the server did not terminate with a newline."""
        line, self._pending = self._pending, b""
        return [line[5:].strip()] if line.startswith(b"data:") else []
