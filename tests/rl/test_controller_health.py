"""The controller's side of "faults fail fast": spoiled groups are replaced, a fault stops every rank
first and raises, the wall-clock budget ends a wait cleanly; groups that can no longer be trained on are
dropped while they play, their episodes stopped on every rank that plays episodes. No MPI, no vLLM: the
controller's parts are real (recipe, trajectory manager), its communicator and manager server are stand-ins."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sfhpc.config.recipe import load_recipe
from sfhpc.data.manager import TrajectoryManager
from sfhpc.rl import messages as msg
from sfhpc.rl.controller import Controller
from sfhpc.rl.health import RolloutStalled, TooManyFailures
from sfhpc.rl.live_status import LiveStatus
from sfhpc.rl.pipeline_policy import PipelinePolicy
from sfhpc.rl.timeline import Timeline

RECIPE = """\
name: faults
algorithm: {group_size: 2}
budgets: {steps: 2, prompts_per_step: 2, max_failed_fraction: 0.5, stall_timeout_s: 0.5, wall_minutes: WALL}
roles:
  controller: {place_with: trainer}
  trainer:    {tags: [train], nodes: 1}
  rollout:    {tags: [rollout], nodes: 1}
"""


class _World:
    def __init__(self) -> None:
        self.sent: list[tuple[object, int]] = []

    def Get_size(self) -> int:  # noqa: N802 - the mpi4py name
        return 3

    def Get_rank(self) -> int:  # noqa: N802
        return 0

    def send(self, message: object, dest: int, tag: int) -> None:
        self.sent.append((message, dest))


class _Attributes:
    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)


def _controller(tmp_path: Path, wall_minutes: float = 60.0, max_token_lag: int | None = None) -> Controller:
    """A Controller with its real state, built without its __init__ (which needs MPI and a launch plan)."""
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE.replace("WALL", str(wall_minutes)))
    recipe = load_recipe(path)
    ctl = object.__new__(Controller)
    world = _World()
    served = threading.Thread(target=lambda: None)
    served.start()
    values = {
        "recipe": recipe, "policy": PipelinePolicy.of(recipe), "run_dir": tmp_path,
        "manager": TrajectoryManager(max_token_lag=max_token_lag), "version": 0,
        "layout": _Attributes(world=world),
        "server": _Attributes(first_one_way_failure=None, last_seen={}, episodes_ended={}),
        "scheduler": _Attributes(rollout_ranks=(1, 2), begin_step=lambda step: None, timeline=Timeline()),
        "stop_watch": _Attributes(stop_requested=lambda: None),
        "_serving": served, "_stop_serving": threading.Event(), "stopping": None, "step_done": 0,
        "hopeless_checked": 0, "hopeless_groups": 0, "open_groups": {}, "restart": 0, "job_id": None, "_overdue": 0,
        "_overdue_at": (-1, -1, -1), "sampling": None, "attached": None,
        "started": time.monotonic(),
        "live": LiveStatus(tmp_path, restart=0, job_id=None),
    }
    ctl.__dict__.update(values)
    for group in ("g0", "g1"):  # one step's groups handed out (sync)
        ctl.manager.book_group(group)
    return ctl


def test_a_group_spoiled_by_a_failure_is_replaced_and_a_fault_stops_every_rank(tmp_path: Path) -> None:
    ctl = _controller(tmp_path)
    handed_out: list[int] = []
    ctl.keep_rollouts_busy = lambda: handed_out.append(ctl.groups_out)  # type: ignore[method-assign]
    for group in ("g0", "g1"):  # both groups fail: more than half of the episodes that ended
        for _ in range(2):
            ctl.manager.fail(ctl.manager.start([1], group=group), "ValueError: bad reply")
    with pytest.raises(TooManyFailures, match="4 of the 4 episodes that ended failed"):
        ctl.wait_for_batch(1)
    assert handed_out == []  # the fault was found first: no new episodes for a run that stops
    assert [(type(m), dest) for m, dest in ctl.layout.world.sent] == [(msg.Stop, 1), (msg.Stop, 2)]
    assert '"event": "fault"' in (tmp_path / "events.jsonl").read_text()


def test_replacing_spoiled_groups_keeps_the_run_going(tmp_path: Path) -> None:
    ctl = _controller(tmp_path, wall_minutes=0.002)  # 120 ms: the wait ends by the budget, not by a batch
    handed_out: list[int] = []

    def replace() -> None:
        handed_out.append(ctl.groups_out)
        ctl.manager.book_group(f"new{len(handed_out)}")

    ctl.keep_rollouts_busy = replace  # type: ignore[method-assign]
    ctl.manager.fail(ctl.manager.start([1], group="g0"), "KeyError: 'x'")
    ctl.server.last_seen.update({1: time.monotonic() + 3600, 2: time.monotonic() + 3600})  # never silent
    assert ctl.wait_for_batch(1) is None  # budgets.wall_minutes ran out while waiting: a clean stop
    assert handed_out == [1]  # g0 was replaced once
    assert ctl.layout.world.sent == []


def test_silent_rollout_ranks_stop_the_run_naming_them(tmp_path: Path) -> None:
    ctl = _controller(tmp_path)
    ctl.keep_rollouts_busy = lambda: None  # type: ignore[method-assign]
    with pytest.raises(RolloutStalled, match=r"silent rollout ranks: 1 \(\d s\), 2 \(\d s\)"):
        ctl.wait_for_batch(1)  # nothing ever arrives: 0.5 s of silence is the recipe's stall timeout


def test_groups_that_can_no_longer_be_trained_on_are_dropped_and_their_episodes_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ctl = _controller(tmp_path, max_token_lag=1)
    withdrawn: list[tuple[int, int]] = []
    ctl.scheduler.assignable_ranks = (1, 2)
    ctl.scheduler.withdraw = lambda rank, episodes: withdrawn.append((rank, episodes))
    monkeypatch.setattr(msg, "receive", lambda comm, rank, tag, **_: msg.Cancelled(rank, rank))
    for group in ("g-old", "g-new"):
        ctl.manager.book_group(group)
    old = ctl.manager.start([1], group="g-old")
    ctl.manager.add_generated(old, [2, 3], [-0.1, -0.1], 0)  # a long reply begun by version 0
    new = ctl.manager.start([1], group="g-new")
    ctl.manager.add_generated(new, [2], [-0.1], 1)
    ctl.version = 2
    assert ctl.drop_hopeless_groups() == 1
    assert [(type(m), getattr(m, "groups", None), dest) for m, dest in ctl.layout.world.sent] == \
        [(msg.Cancel, ("g-old",), 1), (msg.Cancel, ("g-old",), 2)]
    assert withdrawn == [(1, 1), (2, 2)]  # the scheduler no longer counts the stopped episodes in flight
    assert ctl.manager.status(old) == "stale" and ctl.manager.status(new) == "running"
    assert not ctl.manager.in_flight("g-old") and ctl.groups_out == 3 and ctl.hopeless_groups == 1
    assert ctl.drop_hopeless_groups() == 0 and len(ctl.layout.world.sent) == 2  # once per version
