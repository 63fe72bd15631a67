"""The pipeline policy as a table of situations, and its one copy: the controller and the simulator ask it."""

from __future__ import annotations

from pathlib import Path

import pytest

from sfhpc.data.manager import TrajectoryManager
from sfhpc.rl import controller
from sfhpc.rl.pipeline_policy import PipelinePolicy
from sfhpc.sim import pipeline as sim_pipeline


@pytest.mark.parametrize("mode, staleness, in_flight, overdue, admitted", [
    ("sync", 0, 0, 0, 4),       # one step's groups
    ("sync", 3, 0, 0, 4),       # sync never runs ahead, whatever the bound
    ("sync", 3, 4, 2, 0),       # and an overdue group still holds its place: it trains on its own version
    ("async", 0, 0, 0, 4),      # S = 0: one step's worth
    ("async", 2, 0, 0, 12),     # (S + 1) steps of groups
    ("async", 2, 12, 0, 0),     # full
    ("async", 2, 10, 0, 2),     # two trained or dropped: two more
    ("async", 2, 12, 3, 3),     # three overdue groups (still playing, more than S versions behind) hold no place
    ("async", 2, 2, 5, 12),     # never more than the book holds
    ("seamless", 1, 7, 1, 2),   # seamless admits as async does
])
def test_admission_keeps_what_can_still_be_trained_within_the_bound(mode: str, staleness: int, in_flight: int,
                                                                      overdue: int, admitted: int) -> None:
    assert PipelinePolicy(mode, 4, staleness).admit(in_flight, overdue) == admitted


@pytest.mark.parametrize("staleness, lag", [(0, 1), (1, 2), (2, 3), (5, 6)])
def test_a_group_is_overdue_once_its_oldest_token_lags_beyond_the_bound(staleness: int, lag: int) -> None:
    assert PipelinePolicy("async", 4, staleness).overdue_lag == lag


@pytest.mark.parametrize("max_token_lag, version, oldest, newest, trainable, hopeless", [
    (None, 9, 0, 9, True, False),    # no age bound: a reply that crossed nine updates trains, corrected per token
    (None, 3, None, None, True, False),  # no token yet
    (None, 3, 2, 4, False, False),   # a token newer than the policy (weights a restart lost): never trained
    (2, 5, 3, 5, True, False),       # lags 2: within the bound
    (2, 5, 2, 5, False, True),       # lags 3: dropped, and hopeless while it still plays
    (0, 4, 4, 4, True, False),
    (0, 5, 4, 5, False, True),
])
def test_staleness_drops_a_group_only_under_a_token_lag_bound(max_token_lag: int | None, version: int,
                                                              oldest: int | None, newest: int | None,
                                                              trainable: bool, hopeless: bool) -> None:
    policy = PipelinePolicy("async", 4, 1, max_token_lag)
    assert policy.trainable(version, oldest, newest) is trainable
    assert policy.hopeless(version, oldest) is hopeless


@pytest.mark.parametrize("mode, rebalance, rebalances, to_lent", [
    ("seamless", True, True, False),    # lent ranks take the oldest groups' running episodes, new ones go elsewhere
    ("seamless", False, False, True),   # without rebalancing, new episodes are what lent ranks play
    ("async", True, False, True),       # nothing is lent
])
def test_new_episodes_go_to_lent_ranks_only_without_rebalancing(mode: str, rebalance: bool, rebalances: bool,
                                                                 to_lent: bool) -> None:
    policy = PipelinePolicy(mode, 4, 1, rebalance=rebalance)
    assert (policy.rebalances, policy.new_episodes_to_lent) == (rebalances, to_lent)


@pytest.mark.parametrize("complete, ready", [(0, False), (3, False), (4, True), (9, True)])
def test_a_batch_is_ready_with_a_steps_worth_of_complete_groups(complete: int, ready: bool) -> None:
    assert PipelinePolicy("async", 4, 1).batch_ready(complete) is ready


@pytest.mark.parametrize("mode, lent, ready, to_lend, reclaim", [
    ("seamless", (), False, (1, 2), False),   # the trainer waits: lend every lendable rank
    ("seamless", (1,), False, (2,), False),   # only those not lent yet
    ("seamless", (), True, (), False),        # the batch is ready already: lending would only cost two switches
    ("seamless", (1, 2), True, (), True),     # ready with ranks lent: reclaim them
    ("async", (), False, (), False),          # async lends nothing
    ("sync", (), False, (), False),
])
def test_lending_and_reclaiming(mode: str, lent: tuple[int, ...], ready: bool, to_lend: tuple[int, ...],
                                reclaim: bool) -> None:
    policy = PipelinePolicy(mode, 4, 1)
    assert policy.to_lend((1, 2), lent, batch_ready=ready) == to_lend
    assert policy.reclaim_now(lent, batch_ready=ready) is reclaim


RUNNING = {5: [(3, "a"), (1, "b"), (2, "c"), (4, "d")], 6: [(0, "e"), (9, "f")], 7: [(8, "g")],
           8: [(7, "h"), (6, "i"), (5, "j"), (2, "k")]}


@pytest.mark.parametrize("drained, waits, moves", [
    ((1,), True, {5: ["b", "c"]}),                  # the most loaded (ties: lower rank), half, oldest groups first
    ((1, 2), True, {5: ["b", "c"], 8: ["k", "j"]}),  # one donor per drained rank
    ((1, 2, 3, 4), True, {5: ["b", "c"], 8: ["k", "j"], 6: ["e"]}),  # a rank with one sequence gives none
    ((1,), False, {}),                              # the batch is ready: nothing moves
    ((), True, {}),
])
def test_rebalancing_moves_half_of_the_most_loaded_ranks_oldest_groups(drained: tuple[int, ...], waits: bool,
                                                                       moves: dict[int, list[str]]) -> None:
    policy = PipelinePolicy("seamless", 4, 1)
    assert policy.rebalance_moves(drained, RUNNING, trainer_waits=waits) == moves
    loads = {rank: len(running) for rank, running in RUNNING.items()}
    assert policy.rebalance_counts(drained, loads, trainer_waits=waits) == {d: len(m) for d, m in moves.items()}
    off = PipelinePolicy("seamless", 4, 1, rebalance=False)
    assert off.rebalance_moves(drained, RUNNING, trainer_waits=waits) == {}
    assert PipelinePolicy("async", 4, 1).rebalance_counts(drained, loads, trainer_waits=waits) == {}


def test_bad_settings_are_refused() -> None:
    for args in (("fast", 4, 1), ("async", 0, 1), ("async", 4, -1)):
        with pytest.raises(ValueError):
            PipelinePolicy(*args)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        PipelinePolicy("async", 4, 1, -1)


def test_the_controller_and_the_simulator_ask_the_same_policy() -> None:
    assert controller.PipelinePolicy is sim_pipeline.PipelinePolicy is PipelinePolicy
    config = sim_pipeline.SimConfig("seamless", sim_pipeline.Workload("w"), prompts_per_step=3, max_staleness=2,
                                    max_token_lag=4, rebalance=False)
    assert config.policy() == PipelinePolicy("seamless", 3, 2, 4, rebalance=False)


def test_the_manager_counts_overdue_and_complete_groups_without_taking_them() -> None:
    manager = TrajectoryManager()
    for group in ("late", "fresh", "done"):
        manager.book_group(group)
    late = manager.start([1], group="late")
    manager.add_generated(late, [2, 3], [-0.1, -0.1], 0)  # still playing, begun by version 0
    fresh = manager.start([1], group="fresh")
    manager.add_generated(fresh, [2], [-0.1], 2)
    done = manager.start([1], group="done")
    manager.add_generated(done, [2], [-0.1], 0)
    manager.finish(done, 1.0)
    assert manager.overdue_groups(2, lag=2) == 1  # "done" is complete (it holds its place for the batch)
    assert manager.overdue_groups(1, lag=2) == 0
    assert manager.complete_groups(2, group_size=1) == 1 and manager.groups_in_flight() == 3
    assert manager.take_batch(2, 1, group_size=1) is not None and manager.groups_in_flight() == 2


def test_a_group_with_a_member_not_begun_still_plays_for_the_manager_and_the_simulator_alike() -> None:
    """One rule counts overdue groups (`sfhpc.data.groups.overdue`, asked through the policy): a group whose
    begun member finished on version 0 while its other member has not begun still plays, so at version 3
    (S = 2: lag 3) it is overdue for the run's manager, as the simulator counts its own playing groups."""
    policy = PipelinePolicy("async", 1, 2)
    manager = TrajectoryManager()
    manager.book_group("half")
    begun = manager.start([1], group="half")
    manager.add_generated(begun, [2], [-0.1], 0)
    manager.finish(begun, 1.0)
    assert manager.overdue_groups(3, policy.overdue_lag, group_size=2) == 1  # the second member plays yet
    assert manager.overdue_groups(2, policy.overdue_lag, group_size=2) == 0
    assert manager.overdue_groups(3, policy.overdue_lag, group_size=1) == 0  # complete: it holds its place
    assert policy.overdue(3, 0) and not policy.overdue(2, 0) and not policy.overdue(9, None)


def test_a_recipe_of_agent_programs_rebalances_by_routing_generations(tmp_path: Path) -> None:
    from sfhpc.config import load_recipe

    base = ("name: p\ntask: {name: guess-number}\npipeline: {mode: MODE}\nroles: {controller: {place_with: "
            "trainer}, trainer: {tags: [train]}, rollout: {tags: [rollout]}}\n")
    (tmp_path / "a.py").write_text("print('{}')\n")
    plain, programs, async_programs = tmp_path / "plain.yaml", tmp_path / "programs.yaml", tmp_path / "async.yaml"
    plain.write_text(base.replace("MODE", "seamless"))
    programs.write_text(base.replace("MODE", "seamless") + "agent: {command: [python3, a.py]}\n")
    async_programs.write_text(base.replace("MODE", "async") + "agent: {command: [python3, a.py]}\n")
    policy = PipelinePolicy.of(load_recipe(plain))
    assert (policy.rebalances, policy.new_episodes_to_lent, policy.routes_programs) == (True, False, False)
    # A program's episode moves by its generation (`sfhpc.engine.remote`): rebalanced like any other.
    policy = PipelinePolicy.of(load_recipe(programs))
    assert (policy.rebalances, policy.new_episodes_to_lent, policy.routes_programs) == (True, False, True)
    assert not PipelinePolicy.of(load_recipe(async_programs)).routes_programs  # nothing moves outside seamless
