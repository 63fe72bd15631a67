"""`sfhpc.analysis.open_run`: the frames hold what the manager wrote, decoded and filtered as asked."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from sfhpc.analysis import open_run
from sfhpc.analysis.conversation import format_conversation
from sfhpc.data.errors import StoreError, UnknownTrajectory
from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.store import TrajectoryStore
from sfhpc.errors import SfhpcError
from tests.analysis.runs import IDS, PROMPT_TEXT, TOKENIZER, write_run
from tests.data.records import make_trajectory


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_run(tmp_path_factory.mktemp("analysis") / "run")


def test_trajectories_one_row_each_with_versions_interruptions_and_marks(run_dir: Path) -> None:
    with open_run(run_dir) as run:
        df = run.trajectories().set_index("id")
    assert list(df.index) == IDS
    cut = df.loc["cut"]
    assert (cut.status, cut.reward, cut.min_version, cut.max_version, cut.versions, cut.interruptions) \
        == ("consumed", 0.5, 1, 2, 2, 1)
    assert (cut.consumed_step, cut.trained_version, cut.staleness, cut.turns, cut.generated_tokens) \
        == (0, 2, 1, 1, 16)
    assert (df.loc["multi", "turns"], df.loc["multi", "consumed_step"]) == (2, 1)
    assert df.loc["failed", "fail_reason"] == "ValueError: not a digit" and pd.isna(df.loc["failed", "reward"])
    assert pd.isna(df.loc["open", "consumed_step"]) and df.loc["open", "status"] == "running"
    assert str(df["reward"].dtype) == "Float64" and str(df["staleness"].dtype) == "Int64"


def test_filters_select_what_they_say(run_dir: Path) -> None:
    with open_run(run_dir) as run:
        def ids(**filters) -> list[str]:
            return list(run.trajectories(**filters)["id"])

        assert ids(steps=0) == ["plain", "cut"] and ids(steps=(1, None)) == ["multi"]
        assert ids(steps=(None, 5)) == ["plain", "cut", "multi"]
        assert ids(status="failed") == ["failed"] and ids(status=["running", "failed"]) == ["failed", "open"]
        assert ids(min_reward=0.5) == ["plain", "cut"] and ids(max_reward=0.5) == ["cut", "multi"]
        assert ids(min_reward=0.25, max_reward=0.75) == ["cut"]
        assert ids(version=1) == ["plain", "cut"] and ids(version=2) == ["cut", "multi"] and ids(version=7) == []
        assert ids(staleness=1) == ["plain", "cut", "multi"] and ids(staleness=(None, 0)) == []
        assert ids(status="consumed", version=2, steps=1) == ["multi"]


def test_turns_and_segments(run_dir: Path) -> None:
    with open_run(run_dir) as run:
        turns, segments = run.turns(), run.segments()
    assert list(zip(turns["trajectory"], turns["turn"])) == [("plain", 0), ("cut", 0), ("multi", 0), ("multi", 1)]
    cut = turns[turns["trajectory"] == "cut"].iloc[0]
    # One reply, two engine runs: the abort under version 1, the continuation under version 2.
    assert (cut.tokens, cut.segments, cut.versions, cut.min_version, cut.max_version, cut.interruptions,
            cut.finish_reason, cut.engines) == (16, 2, 2, 1, 2, 1, "stop", "rollout-0,rollout-1")
    assert list(turns[turns["trajectory"] == "multi"]["tokens"]) == [3, 2]
    assert len(segments) == 2 + 3 + 4 + 1 + 1
    cut_segments = segments[segments["trajectory"] == "cut"]
    assert list(cut_segments["kind"]) == ["prompt", "generated", "generated"]
    assert list(cut_segments["finish_reason"]) == ["", "abort", "stop"]
    assert list(cut_segments["engine"]) == ["", "rollout-0", "rollout-1"]
    assert list(cut_segments["parent"]) == [-1, 0, 1] and list(cut_segments["fork_at"]) == [0, 16, 7]
    assert list(cut_segments["min_version"].astype("Float64").fillna(-1)) == [-1, 1, 2]
    assert list(segments[segments["trajectory"] == "multi"]["kind"]) == \
        ["prompt", "generated", "observation", "generated"]


def test_steps_join_marks_and_metrics(run_dir: Path) -> None:
    with open_run(run_dir) as run:
        steps = run.steps()
    assert list(steps["step"]) == [0, 1] and list(steps["trajectories"]) == [2, 1]
    assert list(steps["policy_version"]) == [2, 3] and list(steps["reward_mean"]) == [0.75, 0.0]
    assert list(steps["tokens"]) == [18 + 32, 41] and list(steps["generated_tokens"]) == [2 + 16, 5]
    assert list(steps["loss"]) == [0.5, 0.25] and list(steps["version"]) == [2, 3]
    assert list(steps["metrics_reward_mean"]) == [0.75, 0.0]  # the metrics' own column, kept apart


def test_decode_gives_the_text(run_dir: Path) -> None:
    with open_run(run_dir) as run:
        trajectory = run.trajectory("cut")
        assert run.decode(trajectory.context()) == PROMPT_TEXT + "The answer is 5<|end|>"
        assert run.decode(TOKENIZER.encode("ünï")) == "ünï"
        with pytest.raises(UnknownTrajectory, match="nope"):
            run.trajectory("nope")


def test_empty_store_gives_empty_typed_frames(tmp_path: Path) -> None:
    TrajectoryManager(TrajectoryStore.create(tmp_path / "trajectories.h5")).close()
    with open_run(tmp_path / "trajectories.h5") as run:
        df = run.trajectories(status="consumed", steps=(0, 3))
        assert df.empty and str(df["staleness"].dtype) == "Int64"
        assert run.turns().empty and run.segments().empty and run.steps().empty
        assert list(run.steps().columns)[:3] == ["step", "policy_version", "trajectories"]


def test_follows_a_store_that_is_still_written(tmp_path: Path) -> None:
    manager = TrajectoryManager(TrajectoryStore.create(tmp_path / "trajectories.h5"))
    manager.start([1, 2], trajectory_id="first")
    manager.flush()
    with open_run(tmp_path) as run:
        assert list(run.trajectories()["id"]) == ["first"]
        manager.add_generated("first", [3], [-0.5], 4)
        manager.finish("first", reward=1.0)
        manager.start([1], trajectory_id="second")
        manager.flush()
        assert run.refresh()
        df = run.trajectories()
        assert list(df["id"]) == ["first", "second"] and df["max_version"].iloc[0] == 4
    manager.close()


def test_paths_that_are_not_runs(tmp_path: Path) -> None:
    with pytest.raises(SfhpcError, match="no trajectories.h5"):
        open_run(tmp_path)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(StoreError, match="not an HDF5 file"):
        open_run(tmp_path / "notes.txt")


def test_a_forked_trajectory_keeps_both_branches(tmp_path: Path) -> None:
    trajectory = make_trajectory(3)  # a fork inside reply 1: segments 2 and 3 are off the current branch
    with TrajectoryStore.create(tmp_path / "trajectories.h5") as store:
        store.write(trajectory)
    with open_run(tmp_path) as run:
        segments = run.segments()
        first = len(trajectory.segments[1])
        assert list(segments["used"]) == [len(trajectory.segments[0]), first // 2, 0, 0, 5,
                                          len(trajectory.segments[5])]
        # Each reply as its agent received it: the first whole, though the branch keeps half of it.
        assert list(run.turns()["tokens"]) == [first, len(trajectory.segments[5])]
        text = format_conversation(run, run.trajectory(trajectory.id), tokens=True)
    assert "[2] user observation" in text and text.count("off the current branch") == 2
    assert f"forks from [1] at token {first // 2} of {first}" in text
    assert f"current branch uses its first {first // 2}" in text
    assert f"<|{int(trajectory.segments[0].tokens[0])}|>" in text  # ids outside the vocabulary are shown


def test_metrics_of_steps_the_store_has_no_marks_for(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", metrics=False)
    lines = [json.dumps({"step": s, "version": s + 2, "loss": 0.1}) for s in (0, 1, 2)]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 3, "ver')  # a line being written
    with open_run(run_dir) as run:
        steps = run.steps()
    assert list(steps["step"]) == [0, 1, 2] and list(steps["version"]) == [2, 3, 4]
    assert str(steps["trajectories"].dtype) == "Int64" and pd.isna(steps["trajectories"].iloc[2])
