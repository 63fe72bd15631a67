"""The scheduler hands episodes to the rollout rank with the fewest in flight, and lends idle trainer ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from sfhpc.config import load_cluster_map, load_recipe
from sfhpc.plan.resolve import resolve
from sfhpc.rl.messages import EpisodeTicket
from sfhpc.rl.scheduler import Scheduler
from sfhpc.tasks.base import Problem
from tests.conftest import RECIPES


def episodes(n: int) -> list[EpisodeTicket]:
    return [EpisodeTicket(Problem(str(i), i), f"g{i}", i) for i in range(n)]


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


def test_generations_of_several_donors_are_routed_by_one_plan() -> None:
    """Agent programs' generations moved at once from several ranks (a rebalance, a reclaim of several lent
    ranks) spread over the targets by load together: each donor's do not all go to the least loaded rank."""
    s = scheduler()
    s.assign(episodes(3))  # ranks 2 and 3 hold 2 and 1
    plan = s.routes({7: 2, 8: 2, 9: 1}, among=(2, 3))
    assert plan == {7: (3, 2), 8: (3, 2), 9: (3,)}  # loads 2/1 -> 2/2 -> 3/3: level, the lower rank first
    assert s.in_flight(2, {}) == 2 and s.in_flight(3, {}) == 1  # nothing counted until the donors route them
    assert s.routes({7: 3}, among=()) == {7: ()}  # nowhere to go: none routed


def lending_scheduler(*, trainer_tags: str = "[train, rollout]", lending: bool = True,
                      tmp_path: Path | None = None) -> Scheduler:
    cluster = RECIPES / "cluster-dev.yaml"
    if trainer_tags != "[train, rollout]":
        assert tmp_path is not None
        cluster = tmp_path / "cluster.yaml"
        cluster.write_text((RECIPES / "cluster-dev.yaml").read_text().replace("tags: [train, rollout, cpu]",
                                                                               f"tags: {trainer_tags}"))
    plan = resolve(load_recipe(RECIPES / "report.yaml"), load_cluster_map(cluster))
    return Scheduler(plan, lending=lending)


def test_trainer_ranks_tagged_rollout_are_lendable_only_with_lending() -> None:
    assert lending_scheduler().lendable_ranks == (1,)  # the trainer; the controller's rank has no trainer role
    assert lending_scheduler(lending=False).lendable_ranks == ()


def test_the_admin_forbids_lending_by_the_tag(tmp_path: Path) -> None:
    s = lending_scheduler(trainer_tags="[train]", tmp_path=tmp_path)
    assert s.lendable_ranks == ()
    with pytest.raises(ValueError, match="cannot be lent"):
        s.lend((1,))


def test_lent_ranks_take_episodes_until_reclaimed() -> None:
    s = lending_scheduler()
    assert s.lend(s.lendable_ranks) == (1,)
    assert s.lend(s.lendable_ranks) == ()  # already lent: not counted twice
    assert s.entries[1].state.value == "lent" and s.lent_ranks == (1,)
    first = s.assign(episodes(6))
    assert {r: len(e) for r, e in first.items()} == {1: 2, 2: 2, 3: 2}  # the lent trainer is a rollout rank now
    kept = s.assign(episodes(2), to_lent=False)  # new episodes while lent ranks take over running ones instead
    assert {r: len(e) for r, e in kept.items()} == {2: 1, 3: 1} and s.in_flight(1, {}) == 2
    assert s.entries[1].state.value == "lent" and s.entries[2].state.value == "generating"
    assert s.reclaim() == (1,)
    assert s.entries[1].state.value == "waiting" and s.lent_ranks == ()
    assert (s.lends, s.reclaims) == (1, 1)
    # One of its episodes ended there, the other moves: it leaves rank 1's count, and new work skips rank 1.
    s.withdraw(1, 1)
    assert s.in_flight(1, {1: 1}) == 0
    moved = s.assign(episodes(1), ended={1: 1})
    assert list(moved) == [2]
    assert s.reclaim() == ()


def test_colocated_trainer_ranks_roll_out_already_and_are_not_lent() -> None:
    plan = resolve(load_recipe(RECIPES / "report-colocated.yaml"), load_cluster_map(RECIPES / "cluster-dev.yaml"))
    s = Scheduler(plan, lending=True)
    assert s.trainer_ranks and set(s.trainer_ranks) <= set(s.rollout_ranks)
    assert s.lendable_ranks == ()
