"""A crashed run of agent programs with several trajectories an episode (two agents, one asking for two
choices), resumed with ``sfhpc run --resume`` (mpiexec, the test engine, real HDF5): episodes still open at
the crash are aborted whole and played again; every group trained after the restart holds whole episodes
of one hand-out, and no trajectory or episode is trained twice."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest

from sfhpc.analysis import open_run
from sfhpc.data.store import open_store
from tests.conftest import run_sfhpc
from tests.rl.test_crash_resume import HOLD, crash_in_step_6, events, rows
from tests.rollout.test_agent_run import SEVERAL_TRAJECTORIES, TEST_ENGINE

pytestmark = [pytest.mark.mpi]

GROUP, PROMPTS = 2, 2


def test_a_crashed_run_of_two_agents_resumes_with_whole_episodes_trained_once(tmp_path: Path) -> None:
    (tmp_path / "two.py").write_text(SEVERAL_TRAJECTORIES)
    recipe = tmp_path / "crash.yaml"
    recipe.write_text(
        f"name: crash\nseed: 4\n{TEST_ENGINE}\nalgorithm: {{group_size: {GROUP}}}\n"
        "pipeline: {mode: async, max_staleness: 3}\n"
        f"budgets: {{steps: 6, prompts_per_step: {PROMPTS}}}\ntraining: {{checkpoint_every: 3}}\n"
        "task: {name: guess-number}\n"
        f"agent: {{command: [{sys.executable}, {tmp_path / 'two.py'}], workers: 4, serve: true, "
        "timeout_s: 60}\n"
        "roles: {controller: {place_with: trainer}, trainer: {tags: [train], nodes: 1}, "
        f"rollout: {{tags: [rollout], nodes: 1}}}}\noutput_dir: {tmp_path / 'runs'}\n"
    )
    run_dir = crash_in_step_6(recipe, tmp_path / "runs")
    done = run_sfhpc("run", str(recipe), "--resume", str(run_dir), env=HOLD, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (resumed,) = [e for e in events(run_dir) if e["event"] == "resumed"]
    assert [r["step"] for r in rows(run_dir)] == [1, 2, 3, 4, 5, 6]

    with open_store(run_dir / "trajectories.h5") as store:
        marks = store.marks()
    consumed = [m.trajectory_id for m in marks]
    assert len(consumed) == len(set(consumed)), "a trajectory was trained twice"
    with open_run(run_dir) as run:
        frame = run.trajectories().set_index("id")
    step_of = {m.trajectory_id: m.step for m in marks}
    # Every trained episode: whole (its three trajectories), in one step; every trained group: its members.
    episodes: dict[str, list[str]] = collections.defaultdict(list)
    for tid in consumed:
        episodes[frame.loc[tid, "episode"]].append(tid)
    for episode, members in episodes.items():
        assert sorted(frame.loc[members, "agent"]) == ["checker", "solver", "solver"], (episode, members)
        assert len({step_of[m] for m in members}) == 1, (episode, members)
        # Trajectories of an episode it was played in: none of another episode, none left aborted.
        everyone = frame.index[frame["episode"] == episode]
        assert set(everyone) == set(members), (episode, list(everyone))
    # Each allocation's steps train whole groups of GROUP episodes (a step the crash discarded keeps its marks,
    # and the resumed run may train the same group key again with the episodes played anew).
    resumed_at = resumed["time"] - resumed["seconds"]
    time_of = {m.trajectory_id: m.time for m in marks}
    groups = collections.Counter(
        (time_of[m[0]] > resumed_at, step_of[m[0]], frame.loc[m[0], "group"]) for m in episodes.values()
    )
    assert set(groups.values()) == {GROUP} and len(groups) >= 6 * PROMPTS, groups
    # After the restart each group is trained once.
    after = {(m.step, frame.loc[m.trajectory_id, "group"]) for m in marks if m.time > resumed_at}
    assert sorted(step for step, _ in after) == [4] * PROMPTS + [5] * PROMPTS + [6] * PROMPTS, after
    assert collections.Counter(group for _, group in after).most_common(1)[0][1] == 1, after
    # Open episodes at the crash: aborted whole (all their trajectories), played again in their group.
    aborted = frame[frame["status"] == "aborted"]
    for episode in set(aborted["episode"]):
        assert set(frame.loc[frame["episode"] == episode, "status"]) == {"aborted"}, episode
    assert resumed["step"] == 3
