"""What a restarted controller does with the episodes it had out (the manager reloaded from its store)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from sfhpc.data.errors import InvalidRequest
from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.store import TrajectoryStore
from sfhpc.data.trajectory import Status
from sfhpc.rl.messages import EpisodeTicket
from sfhpc.rl.resume import ControllerState, ControllerStateError, plan_resume
from sfhpc.tasks.arith_tool import ArithToolTask
from sfhpc.tasks.base import Problem
from sfhpc.tasks.letters import NextLetterTask


def episodes(group: str, n: int = 2) -> tuple[EpisodeTicket, ...]:
    return tuple(EpisodeTicket(Problem(group, group), group, seed) for seed in range(n))


def test_open_trajectories_continue_missing_ones_replay_stale_groups_drop(tmp_path: Path) -> None:
    store_path = tmp_path / "t.h5"
    manager = TrajectoryManager(TrajectoryStore.open(store_path), max_token_lag=1)
    # g-fresh: one member finished at version 4, one cut mid-generation at version 5
    done = manager.start([1, 2], group="g-fresh")
    manager.add_generated(done, [3], [-0.1], 4, finish_reason="stop")
    manager.finish(done, 1.0)
    cut = manager.start([1, 2], group="g-fresh")
    manager.add_generated(cut, [3, 4], [-0.1, -0.2], 5, finish_reason="abort")
    # g-stale: a member generated at version 2, too old for version 5 with max_staleness 1
    old = manager.start([1], group="g-stale")
    manager.add_generated(old, [3], [-0.1], 2)
    # g-unstarted: handed out, no trajectory yet; g-orphan: not in the checkpoint, still running
    orphan = manager.start([1], group="g-orphan")
    manager.close()

    manager = TrajectoryManager(TrajectoryStore.open(store_path), max_token_lag=1)  # the restarted run
    assert manager.status(cut) == "interrupted"
    state = ControllerState(step=5, version=5, rng=random.Random(0).getstate(), next_group=4,
                            open_groups={"g-fresh": episodes("g-fresh"), "g-stale": episodes("g-stale"),
                                         "g-unstarted": episodes("g-unstarted")})
    plan = plan_resume(state, manager, max_token_lag=1, group_size=2)
    assert [(e.group, e.resume_id) for e in plan.episodes] == [
        ("g-fresh", cut), ("g-unstarted", None), ("g-unstarted", None)]
    assert (plan.resumed, plan.replayed, plan.finished, plan.dropped_stale, plan.abandoned) == (1, 2, 1, 1, 1)
    assert set(plan.groups) == {"g-fresh", "g-unstarted"}
    assert manager.status(old) == Status.STALE and manager.status(orphan) == Status.ABORTED
    manager.close()


def _members(manager: TrajectoryManager, group: str, versions: list[list[int]], *, finish: list[bool]) -> list[str]:
    ids = []
    for tokens_versions, done in zip(versions, finish):
        tid = manager.start([1, 2], group=group)
        manager.add_generated(tid, [3] * len(tokens_versions), [-0.1] * len(tokens_versions), tokens_versions)
        if done:
            manager.finish(tid, 1.0)
        ids.append(tid)
    return ids


def test_groups_of_the_lost_allocation_are_kept_whole_or_dropped_never_merged(tmp_path: Path) -> None:
    """A periodic checkpoint at version 5, then the allocation went on (version 6) and crashed."""
    store_path = tmp_path / "t.h5"
    manager = TrajectoryManager(TrajectoryStore.open(store_path), max_token_lag=1)
    # Out at the checkpoint: one member finished by version 5, the other cut while version 6 wrote it.
    known_done, known_newer = _members(manager, "s1-g4-w", [[5], [5, 6]], finish=[True, False])
    # Handed out after it: g5-x finished by version 5; g6-y written by version 6; g7-z left half done.
    kept = _members(manager, "s1-g5-x", [[5], [5]], finish=[True, True])
    _members(manager, "s1-g6-y", [[6], [6, 6]], finish=[True, False])
    _members(manager, "s1-g7-z", [[5], [5]], finish=[True, False])
    manager.close()

    manager = TrajectoryManager(TrajectoryStore.open(store_path), max_token_lag=1)  # the restarted run
    state = ControllerState(step=5, version=5, rng=random.Random(0).getstate(), next_group=5,
                            open_groups={"s1-g4-w": episodes("s1-g4-w")})
    plan = plan_resume(state, manager, max_token_lag=1, group_size=2)
    assert (plan.dropped_newer, plan.newer_tokens) == (3, 4)  # g4-w's cut member and both of g6-y
    assert (plan.waiting_groups, plan.finished, plan.abandoned, plan.replayed, plan.resumed) == (1, 3, 2, 1, 0)
    assert [(e.group, e.resume_id) for e in plan.episodes] == [("s1-g4-w", None)]  # played again, same group
    assert manager.status(known_newer) == Status.ABORTED and manager.status(known_done) == Status.FINISHED
    assert manager.groups_in_flight() == 2 and manager.in_flight("s1-g4-w") and manager.in_flight("s1-g5-x")
    with pytest.raises(InvalidRequest, match="handed out before"):
        manager.book_group("s1-g5-x")  # the restored counter's next key, as the lost allocation spelt it
    # The restored controller hands g5's problem out again under this session's key: a group of its own.
    new_key = f"s{manager.store.session}-g5-x"
    manager.book_group(new_key)
    new = _members(manager, new_key, [[5], [5]], finish=[True, True])
    batch = manager.take_batch(5, 2, 2, step=6)
    assert batch is not None and [[t.id for t in g] for g in batch.groups] == [kept, new]
    assert {v for t in batch.trajectories for v in t.token_versions().tolist() if v >= 0} == {5}
    assert manager.groups_in_flight() == 1  # s1-g4-w, still to be whole
    manager.close()


def test_controller_state_round_trips_as_plain_data(tmp_path: Path) -> None:
    """The state is JSON; problems go through their task's contract (arith-tool's tuples come back as tuples)."""
    task = ArithToolTask()
    rng = random.Random(7)
    problem = task.sample(rng)
    tickets = tuple(EpisodeTicket(problem, "s1-g0-q", seed) for seed in range(2))
    state = ControllerState(step=3, version=3, rng=rng.getstate(), next_group=9, open_groups={"s1-g0-q": tickets},
                            task_state={"position": 4}, assigned={2: 40})
    state.save(tmp_path / "controller.json", task)
    assert json.loads((tmp_path / "controller.json").read_text())["open_groups"]["s1-g0-q"][1]["seed"] == 1
    loaded = ControllerState.load(tmp_path / "controller.json", task)
    assert loaded == state and isinstance(loaded.open_groups["s1-g0-q"][0].problem.data, tuple)
    restored = random.Random()
    restored.setstate(loaded.rng)
    assert restored.random() == rng.random()


def test_a_task_whose_problems_are_not_plain_data_is_named(tmp_path: Path) -> None:
    class Odd(Problem):
        pass

    state = ControllerState(step=1, version=1, rng=random.Random(0).getstate(), next_group=1,
                            open_groups={"g": (EpisodeTicket(Problem("k", Odd("x", 1)), "g", 0),)})
    with pytest.raises(ControllerStateError, match="task next-letter: its problems or sampler state are not plain"):
        state.save(tmp_path / "controller.json", NextLetterTask())
    assert not (tmp_path / "controller.json").exists()


def test_a_pickled_controller_state_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    """A checkpoint of an earlier version held the controller's state as a pickle: resume says so, and
    unpickles nothing (the pickle here would create a file if it ran)."""
    import pickle

    class Trap:
        def __reduce__(self) -> tuple[object, tuple[str, str]]:
            return (Path.write_text, (tmp_path / "ran", "code"))  # type: ignore[return-value]

    (tmp_path / "controller.pt").write_bytes(pickle.dumps(Trap()))
    with pytest.raises(ControllerStateError, match="earlier sfhpc, whose controller state is a pickle"):
        ControllerState.load(tmp_path / "controller.json", NextLetterTask())
    (tmp_path / "controller.json").write_bytes(pickle.dumps(Trap()))
    with pytest.raises(ControllerStateError, match="cannot read the controller state"):
        ControllerState.load(tmp_path / "controller.json", NextLetterTask())
    assert not (tmp_path / "ran").exists()


def test_episodes_of_two_agents_are_matched_with_their_hand_outs_episode_by_episode(tmp_path: Path) -> None:
    """A group of 2 episodes x 2 agents (a solver and a checker, one trajectory each): one episode ended,
    the other was cut. Each held episode takes one hand-out: the ended one waits for the batch, the cut one
    is played again whole (its programs died), and no trajectory is left interrupted."""
    store_path = tmp_path / "t.h5"
    manager = TrajectoryManager(TrajectoryStore.open(store_path), max_token_lag=1)

    def agents(episode: str) -> list[str]:
        ids = []
        for agent in ("solver", "checker"):
            tid = manager.start([1, 2], group="duo", metadata={"episode": episode, "agent": agent})
            manager.add_generated(tid, [3], [-0.1], 5)
            ids.append(tid)
        return ids

    ended, cut = agents("e1"), agents("e2")
    manager.finish_episode(ended[0], 1.0, others=[(ended[1], 0.0)])
    manager.close()

    manager = TrajectoryManager(TrajectoryStore.open(store_path), max_token_lag=1)  # the restarted run
    assert [manager.status(t) for t in cut] == ["interrupted", "interrupted"]
    state = ControllerState(step=5, version=5, rng=random.Random(0).getstate(), next_group=1,
                            open_groups={"duo": episodes("duo")})
    plan = plan_resume(state, manager, max_token_lag=1, group_size=2)
    assert [(e.group, e.seed, e.resume_id) for e in plan.episodes] == [("duo", 1, None)]  # the second hand-out
    assert (plan.finished, plan.resumed, plan.replayed, plan.abandoned) == (2, 0, 1, 2)
    assert [manager.status(t) for t in cut] == [Status.ABORTED, Status.ABORTED]
    assert [manager.status(t) for t in ended] == [Status.FINISHED, Status.FINISHED]
    manager.close()
