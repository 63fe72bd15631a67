"""The timeline: each rank's state intervals, recorded where the scheduler changes a rank's state, and
the bubble fraction over them (waiting rank-seconds / all rank-seconds, per role)."""

from __future__ import annotations

import pytest

from sfhpc.config import load_cluster_map, load_recipe
from sfhpc.data.rank_intervals import RankInterval, bubble_fraction, bubble_of
from sfhpc.plan.resolve import resolve
from sfhpc.rl.messages import EpisodeTicket
from sfhpc.rl.scheduler import RankState, Scheduler
from sfhpc.rl.timeline import Timeline
from sfhpc.tasks.base import Problem
from tests.conftest import RECIPES


class Clock:
    """A clock the test sets by hand (the scheduler takes any clock: a simulator's discrete-event one)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def episodes(n: int) -> list[EpisodeTicket]:
    return [EpisodeTicket(Problem(str(i), i), f"g{i}", i) for i in range(n)]


def test_bubble_fraction_of_known_intervals() -> None:
    # Rank 1 (trainer): waits 4 s, trains 3 s, syncs 1 s. Rank 2 (rollout): generates 4 s, waits 2 s,
    # generates 1 s, syncs 1 s. Waiting: 4 + 2 = 6 of 16 rank-seconds.
    intervals = [RankInterval(1, "trainer", "waiting", 0, 4), RankInterval(1, "trainer", "training", 4, 7),
                 RankInterval(1, "trainer", "syncing", 7, 8), RankInterval(2, "rollout", "generating", 0, 4),
                 RankInterval(2, "rollout", "waiting", 4, 6), RankInterval(2, "rollout", "generating", 6, 7),
                 RankInterval(2, "rollout", "syncing", 7, 8)]
    bubble = bubble_of(intervals)
    assert bubble.overall == 0.375 and bubble.of("trainer") == 0.5 and bubble.of("rollout") == 0.25
    assert bubble.format() == "37.5% (trainer 50.0%, rollout 25.0%)"
    assert bubble_fraction([], [], [], []).format() == "not recorded"
    lent_and_busy = bubble_fraction(["trainer", "trainer"], ["lent", "waiting"], [0.0, 3.0], [3.0, 4.0])
    assert lent_and_busy.overall == 0.25  # a lent rank with work is busy


def test_the_scheduler_records_a_controlled_schedule() -> None:
    """The same schedule as above, driven through the scheduler as the controller drives it."""
    plan = resolve(load_recipe(RECIPES / "demo.yaml"), load_cluster_map(RECIPES / "cluster-dev.yaml"))
    clock = Clock()
    s = Scheduler(plan, clock=clock)
    assert (s.trainer_ranks, s.rollout_ranks) == ((1,), (2,))
    s.begin_step(1)
    s.assign(episodes(2), ended={})
    assert s.entries[2].state is RankState.GENERATING and s.entries[1].state is RankState.WAITING
    clock.now = 3.0
    s.observe({2: 1})  # one of two ended: still generating
    clock.now = 4.0
    s.observe({2: 2})  # the batch is in: the rollout rank has nothing left
    assert s.entries[2].state is RankState.WAITING
    s.set_state(s.trainer_ranks, RankState.TRAINING)
    clock.now = 6.0
    s.assign(episodes(1), ended={2: 2})  # the next step's episodes go out while the trainer trains
    clock.now = 7.0
    s.set_state((1, 2), RankState.SYNCING)
    clock.now = 8.0
    s.observe({2: 3})  # the episode ended during the sync: the rank stays syncing until it is done
    assert s.entries[2].state is RankState.SYNCING
    s.set_state((1, 2), RankState.WAITING)
    assert s.entries[2].state is RankState.WAITING  # nothing in flight: at rest is waiting
    s.timeline.close()
    recorded = s.timeline.drain()
    assert [(i.rank, i.state, i.t_start, i.t_end) for i in recorded] == [
        (2, "generating", 0.0, 4.0), (1, "waiting", 0.0, 4.0), (2, "waiting", 4.0, 6.0), (1, "training", 4.0, 7.0),
        (2, "generating", 6.0, 7.0), (1, "syncing", 7.0, 8.0), (2, "syncing", 7.0, 8.0)]
    assert {i.role for i in recorded if i.rank == 1} == {"trainer"}
    assert [i.step for i in recorded] == [1, 0, 1, 1, 1, 1, 1]  # rank 1 waited since before step 1 began
    assert 0 not in {i.rank for i in recorded}  # the controller rank has no working state
    assert s.timeline.bubble().overall == 0.375 == bubble_of(recorded).overall
    assert s.timeline.bubble().by_role == {"trainer": 0.5, "rollout": 0.25}
    assert s.timeline.drain() == []  # handed out once


def test_a_lent_rank_with_nothing_in_flight_is_waiting() -> None:
    plan = resolve(load_recipe(RECIPES / "report.yaml"), load_cluster_map(RECIPES / "cluster-dev.yaml"))
    clock = Clock()
    s = Scheduler(plan, lending=True, clock=clock)
    [lendable] = s.lendable_ranks
    s.lend([lendable])
    assert s.timeline.state(lendable) == "waiting"  # lent, no episode yet
    clock.now = 1.0
    plan_out = s.assign(episodes(3), ended={})
    assert lendable in plan_out and s.timeline.state(lendable) == "lent"
    clock.now = 2.0
    s.observe({lendable: len(plan_out[lendable])})
    assert s.entries[lendable].state is RankState.LENT and s.timeline.state(lendable) == "waiting"
    clock.now = 3.0
    s.reclaim()
    s.set_state([lendable], RankState.TRAINING)
    clock.now = 4.0
    s.timeline.close()
    mine = [(i.state, i.t_start, i.t_end) for i in s.timeline.drain() if i.rank == lendable]
    assert mine == [("waiting", 0.0, 1.0), ("lent", 1.0, 2.0), ("waiting", 2.0, 3.0), ("training", 3.0, 4.0)]


def test_timeline_drops_instants_and_can_keep_only_sums() -> None:
    clock = Clock()
    timeline = Timeline(clock, keep_intervals=False)
    timeline.begin(5, "rollout", "waiting")
    timeline.change(5, "generating")  # at the same instant: no interval of zero seconds
    clock.now = 2.0
    timeline.change(5, "waiting")
    clock.now = 3.0
    assert timeline.bubble(including_open=True).of("rollout") == pytest.approx(1 / 3)
    assert timeline.bubble().of("rollout") == 0.0  # closed intervals only
    timeline.close()
    assert timeline.drain() == [] and timeline.intervals_closed == 2
    assert timeline.bubble().format() == "33.3% (rollout 33.3%)"
    timeline.begin(6, "rollout", "waiting")
    with pytest.raises(ValueError, match="already on the timeline"):
        timeline.begin(6, "rollout", "waiting")


def test_a_pause_a_rank_reports_after_the_fact_cuts_its_interval() -> None:
    """A rollout rank's engine paused for a weight update from 2 s to 3 s; the controller learns it at 5 s (the
    rank's reply): the rank generated before and after, and synced only while paused. Reported times outside the
    open interval and now (another node's clock) are kept inside them."""
    clock = Clock()
    timeline = Timeline(clock)
    timeline.begin(2, "rollout", "generating")
    clock.now = 5.0
    timeline.was(2, "syncing", 2.0, 3.0)
    clock.now = 6.0
    timeline.was(2, "syncing", 4.5, 9.0)  # ends after now: cut at now
    timeline.change(2, "waiting")
    clock.now = 7.0
    timeline.close()
    got = [(i.state, i.t_start, i.t_end) for i in timeline.drain()]
    assert got == [("generating", 0.0, 2.0), ("syncing", 2.0, 3.0), ("generating", 3.0, 4.5), ("syncing", 4.5, 6.0),
                   ("waiting", 6.0, 7.0)]
