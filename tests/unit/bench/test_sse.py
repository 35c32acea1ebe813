"""The byte-level SSE splitter the load tool reads every streamed token through."""

from __future__ import annotations

from pytgi_bench.sse import SSEDecoder


def test_events_split_across_chunks_are_joined() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"a"') == []
    assert decoder.feed(b": 1}\n\ndata:") == [b'{"a": 1}']
    assert decoder.feed(b"[DONE]\n\n") == [b"[DONE]"]


def test_several_events_in_one_chunk_keep_their_order() -> None:
    payloads = SSEDecoder().feed(b"data:1\n\ndata: 2\r\n\r\n: keep-alive\n\nevent: x\ndata:3\n\n")
    assert payloads == [b"1", b"2", b"3"]


def test_an_unterminated_last_line_is_returned_on_close() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: last") == []
    assert decoder.close() == [b"last"]
    assert decoder.close() == []
