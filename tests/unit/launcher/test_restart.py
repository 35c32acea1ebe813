"""RestartPolicy: bounded restarts of the shard group, exponential backoff, budget refilled by a
long enough run."""

from __future__ import annotations

import pytest

from pytgi_launcher.restart import RestartPolicy


def test_backoff_doubles_up_to_the_cap_then_the_budget_runs_out() -> None:
    policy = RestartPolicy(max_restarts=7, base_delay_s=1.0, max_delay_s=10.0)
    delays = [policy.next_delay(served_s=5.0) for _ in range(8)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0, None]
    assert policy.used == 7


def test_zero_restarts_is_tgis_behaviour() -> None:
    assert RestartPolicy(max_restarts=0).next_delay(served_s=10**6) is None


def test_a_group_that_served_long_enough_earns_its_budget_back() -> None:
    policy = RestartPolicy(max_restarts=2, reset_after_s=600.0)
    assert policy.next_delay(served_s=1.0) == 1.0
    assert policy.next_delay(served_s=1.0) == 2.0
    assert policy.next_delay(served_s=599.0) is None
    assert policy.next_delay(served_s=600.0) == 1.0, "a fresh budget starts from the first delay"


def test_negative_restarts_are_refused() -> None:
    with pytest.raises(ValueError, match="max_restarts must be >= 0"):
        RestartPolicy(max_restarts=-1)
