"""Stopping criteria: TGI's order (length, EOS, stop sequence) and stop text anywhere in a token."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pytgi_shard.output.stopping import (
    EOS_TOKEN,
    LENGTH,
    STOP_SEQUENCE,
    BatchStops,
    StoppingCriteria,
)

EOS = 2


def feed(stop: StoppingCriteria, steps: list[tuple[int, str]]) -> list[int | None]:
    return [stop(token, text) for token, text in steps]


def test_max_new_tokens_counts_every_token() -> None:
    stop = StoppingCriteria(3, {EOS})
    assert feed(stop, [(5, "a"), (6, "b"), (7, "c")]) == [None, None, LENGTH]
    assert stop.generated == 3


def test_length_wins_over_eos_on_the_last_allowed_token() -> None:
    stop = StoppingCriteria(2, {EOS})
    assert feed(stop, [(5, "a"), (EOS, "")]) == [None, LENGTH]


def test_eos_from_any_of_several_ids_and_ignore_eos() -> None:
    assert feed(StoppingCriteria(10, {EOS, 9}), [(5, "a"), (9, "")]) == [None, EOS_TOKEN]
    assert feed(StoppingCriteria(10, ()), [(EOS, ""), (9, "")]) == [None, None]


def test_stop_sequence_spanning_tokens() -> None:
    stop = StoppingCriteria(10, {EOS}, ["world!"])
    assert feed(stop, [(11, "Hello "), (12, "wor"), (13, ""), (14, "ld"), (15, "!")]) == [
        None, None, None, None, STOP_SEQUENCE,
    ]


def test_stop_sequence_in_the_middle_of_a_token_text() -> None:
    stop = StoppingCriteria(10, {EOS}, ["\n\n"])
    assert feed(stop, [(11, "a\n"), (12, "\nb")]) == [None, STOP_SEQUENCE]
    stop = StoppingCriteria(10, {EOS}, ["cat"])
    assert feed(stop, [(1, "concatenate")]) == [STOP_SEQUENCE]


def test_first_of_several_stop_sequences_and_no_false_match() -> None:
    stop = StoppingCriteria(20, {EOS}, ["xyz", "END"])
    steps = [(11, "x"), (12, "y"), (13, " z"), (14, "E"), (15, "N"), (16, "D")]
    assert feed(stop, steps) == [None] * 5 + [STOP_SEQUENCE]


def test_empty_stop_sequences_are_ignored() -> None:
    stop = StoppingCriteria(3, {EOS}, [""])
    assert feed(stop, [(1, "a"), (1, "b")]) == [None, None]


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.integers(0, 3),  # tokens generated before this batch (a batch ran them)
            st.integers(3, 8),  # max_new_tokens
            st.sets(st.integers(0, 6), max_size=3),  # EOS ids (empty: ignore_eos)
            st.lists(st.integers(0, 8), min_size=8, max_size=8),  # tokens, one per step
        ),
        min_size=1,
        max_size=6,
    ),
    split=st.integers(0, 6),
    ran=st.integers(0, 3),
)
def test_batch_stops_decide_length_and_eos_as_the_criteria(
    rows: list, split: int, ran: int
) -> None:
    """Rows advance together (the finished ones too, unlike a real batch, to cover every step).
    The batch is two parts concatenated; the second part's batch started `ran` steps earlier
    (when its rows had `ran` fewer tokens, as far as they had any) and a copy of the odd rows,
    filtered out of a batch that started as long before, is checked alongside."""
    reference = []
    for done, new, eos, tokens in rows:
        stop = StoppingCriteria(new, eos)
        for token in tokens[:done]:
            stop(token, "")
        reference.append(stop)
    done = [d for d, _, _, _ in rows]

    def started(rows_of: list[int], steps: int) -> BatchStops:
        """The stops of a batch of `rows_of` that started `steps` appends ago."""
        criteria = []
        for i in rows_of:
            stop = StoppingCriteria(rows[i][1], rows[i][2])
            stop.generated = done[i] - steps
            criteria.append(stop)
        return BatchStops.build(criteria)

    def earlier(rows_of: list[int]) -> int:
        """How long ago a batch of `rows_of` can have started (`ran`, as far as they ran)."""
        return min([ran, *(done[i] for i in rows_of)])

    split = min(split, len(rows) - 1) or len(rows)
    parts, steps_of = [started(list(range(split)), 0)], [0]
    if split < len(rows):
        second = list(range(split, len(rows)))
        parts.append(started(second, earlier(second)))
        steps_of.append(earlier(second))
    stops = BatchStops.concatenate(parts, steps_of)
    odd = list(range(1, len(rows), 2))
    steps = earlier(list(range(len(rows))))
    odd_stops = started(list(range(len(rows))), steps).index(odd, steps)
    for step in range(8 - max(done)):
        tokens = [t[d + step] for d, _, _, t in rows]
        expected = []
        for row, (stop, token) in enumerate(zip(reference, tokens, strict=True)):
            reason = stop(token, "")
            if reason is not None:
                expected.append((row, reason))
        assert stops.finished(tokens, step + 1) == expected
        assert odd_stops.finished([tokens[i] for i in odd], step + 1) == [
            (odd.index(row), reason) for row, reason in expected if row in odd
        ]


def test_matches_keeps_the_tail_between_texts() -> None:
    stop = StoppingCriteria(10, (), ["abc"])
    assert [stop.matches(t) for t in ["xa", "", "b", "c"]] == [False, False, False, True]
    assert not StoppingCriteria(10, ()).matches("abc")


def test_a_long_stop_sequence_spanning_short_texts_is_found() -> None:
    """The kept tail is the last (longest stop - 1) characters even while fewer have been seen:
    a stop sequence longer than the text so far must still match once the text holds it (a
    negative slice start once kept only the last 3 characters of "egegUnto")."""
    stopping = StoppingCriteria(40, [], ["UntoUntoUnto"])
    texts = ["eg", "eg", "Unto", "Unto"]
    assert [stopping.matches(t) for t in texts] == [False] * 4
    assert stopping.matches("Unto")
    primed = StoppingCriteria(40, [], ["UntoUntoUnto"])
    primed.prime("egUnto")
    assert not primed.matches("Un") and primed.matches("toUnto")
