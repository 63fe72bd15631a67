"""The checks that stop a faulty run: too many failed episodes, silent rollout ranks, a failed one-way call."""

from __future__ import annotations

import pytest

from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.service import OneWayFailure
from sfhpc.rl.health import (
    ManagerCallFailed,
    RolloutStalled,
    TooManyFailures,
    check_failures,
    check_one_way,
    check_stall,
)


def _episode(manager: TrajectoryManager, group: str, reason: str | None) -> None:
    tid = manager.start([1], group=group)
    if reason is None:
        manager.finish(tid, 1.0)
    else:
        manager.fail(tid, reason)


def _check(manager: TrajectoryManager, max_fraction: float = 0.5) -> None:
    check_failures(manager.counts(), manager.fail_reasons(), max_fraction=max_fraction, min_ended=4)


def test_the_run_stops_once_more_than_the_allowed_fraction_of_ended_episodes_failed() -> None:
    manager = TrajectoryManager()
    _episode(manager, "a", "ValueError: invalid literal for int() with base 10: '²'")
    _check(manager)  # 1 of 1, but less than a step's worth (4) has ended: one early failure is no verdict
    _episode(manager, "b", None)
    _episode(manager, "c", None)
    _episode(manager, "d", "timed out after\n600 s")
    _check(manager)  # 2 of 4: not *more* than half
    manager.start([1], group="e")  # still playing: not counted either way
    _check(manager, max_fraction=1.0)
    _episode(manager, "f", "KeyError: 'answer'")
    _check(manager, max_fraction=1.0)  # 1: never stop for failures
    with pytest.raises(TooManyFailures) as info:
        _check(manager)
    message = str(info.value)
    assert message.startswith("3 of the 5 episodes that ended failed, more than budgets.max_failed_fraction (0.5)")
    assert "first reasons: ValueError: invalid literal for int() with base 10: '²'; timed out after 600 s; " \
           "KeyError: 'answer'" in message
    assert "\n" not in message


def test_the_run_stops_when_every_rollout_rank_went_silent() -> None:
    last_seen = {1: 100.0, 2: 350.0}
    check_stall(last_seen, (1, 2), since=50.0, now=700.0, timeout_s=600.0)  # rank 2 spoke 350 s ago
    check_stall({}, (1, 2), since=500.0, now=700.0, timeout_s=600.0)  # the wait began 200 s ago
    with pytest.raises(RolloutStalled) as info:
        check_stall(last_seen, (1, 2), since=50.0, now=1000.0, timeout_s=600.0)
    message = str(info.value)
    assert message.startswith("no trajectory event reached the manager for 650 s (budgets.stall_timeout_s = 600)")
    assert "silent rollout ranks: 1 (900 s), 2 (650 s)" in message
    assert "logs/rank-001.log, logs/rank-002.log" in message and "\n" not in message
    # Time before the wait began is not silence (the controller was training, rollout was idle).
    check_stall({1: 0.0}, (1,), since=900.0, now=1000.0, timeout_s=600.0)


def test_a_failed_one_way_call_stops_the_run() -> None:
    check_one_way(None)
    with pytest.raises(ManagerCallFailed, match="a one-way finish call from rank 3 to the trajectory manager "
                                                "failed: trajectory 'x' is consumed; it takes"):
        check_one_way(OneWayFailure(3, "finish", "trajectory 'x' is consumed;\nit takes no more tokens"))
