"""The scheduler hands episodes to the rollout rank with the fewest in flight."""

from __future__ import annotations

from sfhpc.config import load_cluster_map, load_recipe
from sfhpc.launch.resolve import resolve
from sfhpc.rl.messages import Episode
from sfhpc.rl.scheduler import Scheduler
from sfhpc.tasks.base import Problem
from tests.conftest import RECIPES


def episodes(n: int) -> list[Episode]:
    return [Episode(Problem(str(i), i), f"g{i}", i) for i in range(n)]


def scheduler() -> Scheduler:
    plan = resolve(load_recipe(RECIPES / "report.yaml"), load_cluster_map(RECIPES / "cluster-dev.yaml"))
    made = Scheduler(plan)
    assert made.rollout_ranks == (2, 3)
    return made


def test_episodes_go_to_the_rank_with_the_fewest_in_flight() -> None:
    s = scheduler()
    first = s.assign(episodes(4))
    assert {r: len(e) for r, e in first.items()} == {2: 2, 3: 2}  # nothing in flight: alternate
    # Rank 2's episodes ended, rank 3's still run (long replies): new work goes to rank 2 first.
    second = s.assign(episodes(3), ended={2: 2})
    assert {r: len(e) for r, e in second.items()} == {2: 3}
    assert s.in_flight(2, {2: 2}) == 3 and s.in_flight(3, {2: 2}) == 2
    third = s.assign(episodes(2), ended={2: 2})
    assert {r: len(e) for r, e in third.items()} == {2: 1, 3: 1}  # level again, the lower rank first
    assert s.entries[2].assigned == 6 and s.entries[3].assigned == 3  # lifetime counts, for the table
