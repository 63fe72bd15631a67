"""What a restarted controller does with the episodes it had out (the manager reloaded from its store)."""

from __future__ import annotations

import random
from pathlib import Path

from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.store import TrajectoryStore
from sfhpc.data.trajectory import Status
from sfhpc.rl.messages import Episode
from sfhpc.rl.resume import ControllerState, plan_resume
from sfhpc.tasks.base import Problem


def episodes(group: str, n: int = 2) -> tuple[Episode, ...]:
    return tuple(Episode(Problem(group, group), group, seed) for seed in range(n))


def test_open_trajectories_continue_missing_ones_replay_stale_groups_drop(tmp_path: Path) -> None:
    store_path = tmp_path / "t.h5"
    manager = TrajectoryManager(TrajectoryStore.open(store_path), max_staleness=1)
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

    manager = TrajectoryManager(TrajectoryStore.open(store_path), max_staleness=1)  # the restarted run
    assert manager.status(cut) == "interrupted"
    state = ControllerState(step=5, version=5, rng=random.Random(0).getstate(), next_group=4,
                            open_groups={"g-fresh": episodes("g-fresh"), "g-stale": episodes("g-stale"),
                                         "g-unstarted": episodes("g-unstarted")})
    plan = plan_resume(state, manager, max_staleness=1, group_size=2)
    assert [(e.group, e.resume_id) for e in plan.episodes] == [
        ("g-fresh", cut), ("g-unstarted", None), ("g-unstarted", None)]
    assert (plan.resumed, plan.replayed, plan.finished, plan.dropped_stale, plan.abandoned) == (1, 2, 1, 1, 1)
    assert set(plan.groups) == {"g-fresh", "g-unstarted"}
    assert manager.status(old) == Status.STALE and manager.status(orphan) == Status.ABORTED
    manager.close()


def test_controller_state_round_trips(tmp_path: Path) -> None:
    rng = random.Random(7)
    state = ControllerState(step=3, version=3, rng=rng.getstate(), next_group=9,
                            open_groups={"g": episodes("g")}, assigned={2: 40})
    state.save(tmp_path / "controller.pt")
    loaded = ControllerState.load(tmp_path / "controller.pt")
    assert loaded == state
    restored = random.Random()
    restored.setstate(loaded.rng)
    assert restored.random() == rng.random()
