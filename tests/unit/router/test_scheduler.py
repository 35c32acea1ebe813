"""The batching task's decisions (pure functions): when and how much to admit."""

from __future__ import annotations

from pytgi_router.core.scheduler import (
    BatchLimits,
    Budgets,
    concat_reason,
    extension_limits,
    new_batch_limits,
)

BUDGETS = Budgets(
    max_batch_prefill_tokens=512,
    max_batch_total_tokens=4096,
    max_batch_size=None,
    waiting_served_ratio=0.3,
    max_waiting_tokens=20,
)


def test_new_batch_takes_as_much_as_budgets_allow() -> None:
    assert new_batch_limits(BUDGETS) == BatchLimits(None, None, 512, 4096)
    capped = Budgets(512, 4096, max_batch_size=8)
    assert new_batch_limits(capped).max_size == 8


def test_small_running_batch_admits_any_waiting_request() -> None:
    # floor(1 x 0.3) = 0: a lone running request never keeps a newcomer waiting.
    limits = extension_limits(BUDGETS, running_size=1, running_tokens=100, waiting_steps=1)
    assert limits.min_size == 0
    assert limits.token_budget == 3996
    assert limits.prefill_token_budget == 512


def test_large_running_batch_needs_enough_newcomers() -> None:
    limits = extension_limits(BUDGETS, running_size=16, running_tokens=0, waiting_steps=5)
    assert limits.min_size == 4  # floor(16 x 0.3)
    assert concat_reason(limits) == "backpressure"


def test_waiting_long_enough_lifts_the_ratio() -> None:
    limits = extension_limits(BUDGETS, running_size=16, running_tokens=0, waiting_steps=20)
    assert limits.min_size is None
    assert concat_reason(limits) == "wait_exceeded"
    assert extension_limits(BUDGETS, 16, 0, 19).min_size == 4


def test_max_batch_size_leaves_room_for_the_difference() -> None:
    capped = Budgets(512, 4096, max_batch_size=8)
    assert extension_limits(capped, 5, 0, 1).max_size == 3
    assert extension_limits(capped, 8, 0, 1).max_size == 0
    assert extension_limits(capped, 9, 0, 1).max_size == 0


def test_token_budget_is_what_the_running_batch_leaves() -> None:
    assert extension_limits(BUDGETS, 3, 4096, 1).token_budget == 0
    assert extension_limits(BUDGETS, 3, 1000, 1).token_budget == 3096


def test_ratio_zero_admits_immediately() -> None:
    eager = Budgets(512, 4096, waiting_served_ratio=0.0)
    assert extension_limits(eager, 100, 0, 1).min_size == 0
