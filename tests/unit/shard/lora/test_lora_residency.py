"""SlotTable, the --max-loras policy: adapters a step needs are resident, the victim is the least
recently used adapter neither needed nor busy, and a step past the cap is refused untouched."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytgi_shard.lora.residency import SlotsExhausted, SlotTable


def test_free_slots_first_then_the_least_recently_used_idle_adapter() -> None:
    table = SlotTable(2)
    assert [(m.index, m.slot, m.evicted) for m in table.place([1])] == [(1, 1, None)]
    assert [(m.index, m.slot, m.evicted) for m in table.place([2])] == [(2, 2, None)]
    table.place([1])  # 1 is now the most recently used
    moves = table.place([3])
    assert [(m.index, m.slot, m.evicted) for m in moves] == [(3, 2, 2)]
    assert table.resident() == [1, 3]
    assert table.place([3]) == []  # resident: nothing to copy


def test_busy_adapters_are_never_evicted() -> None:
    table = SlotTable(2)
    table.place([1, 2])
    moves = table.place([3], busy={1})
    assert [(m.slot, m.evicted) for m in moves] == [(2, 2)]
    with pytest.raises(SlotsExhausted, match="--max-loras 2"):
        table.place([4], busy={1, 3})
    assert table.resident() == [1, 3]  # unchanged by the refusal


def test_a_dropped_adapter_frees_its_slot() -> None:
    table = SlotTable(2)
    table.place([1, 2])
    assert table.drop(1) == 1
    assert table.drop(1) is None
    assert [(m.index, m.slot, m.evicted) for m in table.place([5])] == [(5, 1, None)]


steps = st.lists(
    st.tuples(st.sets(st.integers(0, 7), max_size=4), st.sets(st.integers(1, 7), max_size=3),
              st.booleans()),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(slots=st.integers(1, 4), ops=steps)
def test_placement_invariants(slots: int, ops: list[tuple[set[int], set[int], bool]]) -> None:
    """Against a plain model of the LRU order: after each place, the needed adapters are
    resident, busy residents kept their slots, each eviction took the least recently used
    candidate, slots stay distinct within 1..slots; a refusal happens exactly when the needed
    ones cannot all fit beside the busy ones, and changes nothing."""
    table = SlotTable(slots)
    order: list[int] = []  # resident, least recently used first
    slot: dict[int, int] = {}
    for needed, busy_pick, drop in ops:
        busy = {i for i in busy_pick if i in slot}
        if drop and busy_pick:
            victim = min(busy_pick)
            assert table.drop(victim) == slot.pop(victim, None)
            if victim in order:
                order.remove(victim)
            continue
        want = [i for i in sorted(needed) if i > 0]
        missing = [i for i in want if i not in slot]
        candidates = [i for i in order if i not in set(want) | busy]
        free = slots - len(slot)
        if len(missing) > free + len(candidates):
            with pytest.raises(SlotsExhausted):
                table.place(want, busy)
            assert table.resident() == order
            continue
        before = dict(slot)
        moves = table.place(want, busy)
        for move in moves:
            assert move.index in missing
            if move.evicted is not None:
                assert move.evicted == candidates.pop(0)
                order.remove(move.evicted)
                assert slot.pop(move.evicted) == move.slot
            else:
                assert move.slot not in slot.values()
            slot[move.index] = move.slot
            order.append(move.index)
        for i in want:
            order.remove(i)
            order.append(i)
        assert table.resident() == order
        assert all(table.slot_of(i) == s for i, s in slot.items())
        assert sorted(slot.values()) == sorted(set(slot.values()))
        assert all(1 <= s <= slots for s in slot.values())
        assert all(before[i] == slot[i] for i in busy)
