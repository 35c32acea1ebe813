"""Stopping criteria: TGI's order (length, EOS, stop sequence) and stop text anywhere in a token."""

from __future__ import annotations

from pytgi_shard.stopping import EOS_TOKEN, LENGTH, STOP_SEQUENCE, StoppingCriteria

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
