"""The hand-written wire bytes against the message API: the same serialisation, byte for byte,
step after step of one writer (whose kept token bytes must follow a token's text when it
changes)."""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.output.wire import GenerationWriter, request_field, varint

SPECIAL = frozenset({0, 2, 70000})
# Any float32 (NaN, infinities, -0.0 and subnormals included), as a float32 tensor holds them.
_FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
_ROW = st.tuples(
    st.one_of(st.integers(0, 300), st.integers(0, 2**64 - 1)),  # request id
    # Token ids: a few small ones recur within and across steps, with other texts.
    st.one_of(st.sampled_from(sorted(SPECIAL)), st.integers(0, 3), st.integers(0, 2**32 - 1)),
    _FLOAT32,
    st.one_of(st.just(""), st.text(max_size=5), st.text(min_size=100, max_size=300)),
)


def by_api(rows: list[tuple[int, int, float, str]]) -> pb.DecodeResponse:
    out = pb.DecodeResponse()
    for request_id, token, logprob, text in rows:
        out.generations.add(
            request_id=request_id,
            tokens=pb.Tokens(
                ids=[token], logprobs=[logprob], texts=[text], is_special=[token in SPECIAL]
            ),
        )
    return out


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(st.lists(_ROW, max_size=6), min_size=1, max_size=3))
def test_wire_bytes_are_the_message_apis(steps: list[list[tuple[int, int, float, str]]]) -> None:
    writer = GenerationWriter(SPECIAL)
    for rows in steps:
        ids, tokens, logprobs, texts = (
            (list(column) for column in zip(*rows, strict=True)) if rows else ([], [], [], [])
        )
        fields = [request_field(i) for i in ids]
        wire = writer.one_token_generations(fields, tokens, logprobs, texts)
        expected = by_api(rows).SerializeToString(deterministic=True)
        assert wire == expected
        parsed = pb.DecodeResponse()
        parsed.MergeFromString(wire)
        assert parsed.SerializeToString(deterministic=True) == expected
        # NaN != NaN: compare the float32 bits of each logprob.
        bits = [struct.pack("<f", g.tokens.logprobs[0]) for g in parsed.generations]
        assert bits == [struct.pack("<f", lp) for lp in logprobs]


@given(n=st.integers(0, 2**64 - 1))
def test_varint_round_trips_through_protobuf(n: int) -> None:
    parsed = pb.Generation()
    parsed.MergeFromString(b"\x08" + varint(n))
    assert parsed.request_id == n
    assert b"\x08" + varint(n) == pb.Generation(request_id=n).SerializeToString() or n == 0
