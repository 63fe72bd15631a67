"""The trajectories of an episode of several agents name their agent and episode: in `open_run(...)`'s
frame (the fast columns and the per-record definition agree), in ``traj export`` and in ``traj show``."""

from __future__ import annotations

import csv
from pathlib import Path

import pandas as pd

from sfhpc.analysis import open_run, trajectory_rows
from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.store import TrajectoryStore, open_store
from sfhpc.engine.tokenizer import END
from tests.analysis.runs import TOKENIZER, reply
from tests.conftest import run_sfhpc


def write_two_agents(folder: Path) -> Path:
    """One episode of a solver and a checker (group g), and one agent alone (group h)."""
    folder.mkdir()
    manager = TrajectoryManager(TrajectoryStore.create(folder / "trajectories.h5"))
    prompt = TOKENIZER.apply_chat_template([{"role": "user", "content": "What is 2+3?"}])
    for tid, meta, group in (("solver-1", {"agent": "solver", "episode": "ep-1"}, "g"),
                             ("checker-1", {"agent": "checker\x1b[31m", "episode": "ep-1"}, "g"),
                             ("alone", {"note": "an agent of its own"}, "h")):
        manager.start(prompt, task="arith", group=group, metadata=meta, trajectory_id=tid)
        manager.add_generated(tid, reply("5") + [END], [-0.5, -0.25], 1, finish_reason="stop")
        manager.finish(tid, reward=1.0)
    manager.close()
    return folder


def test_an_analyst_tells_a_solvers_trajectories_from_a_checkers(tmp_path: Path) -> None:
    run_dir = write_two_agents(tmp_path / "run")
    with open_run(run_dir) as run:
        frame = run.trajectories().set_index("id")
    assert frame.loc["solver-1", "agent"] == "solver" and frame.loc["checker-1", "agent"] == "checker\x1b[31m"
    assert frame.loc["solver-1", "episode"] == frame.loc["checker-1", "episode"] == "ep-1"
    assert frame.loc["alone", "agent"] == "" and frame.loc["alone", "episode"] == "alone"
    assert str(frame["agent"].dtype) == "string"
    with open_store(run_dir / "trajectories.h5") as store:  # the record-by-record definition says the same
        rows = {row["id"]: (row["agent"], row["episode"]) for row in trajectory_rows(store)}
    assert rows == {tid: (frame.loc[tid, "agent"], frame.loc[tid, "episode"]) for tid in frame.index}

    out = tmp_path / "t.csv"
    assert run_sfhpc("traj", "export", str(run_dir), "--out", str(out)).returncode == 0
    with out.open(encoding="utf-8") as handle:
        exported = {r["id"]: (r["agent"], r["episode"]) for r in csv.DictReader(handle)}
    assert exported["solver-1"] == ("solver", "ep-1") and exported["alone"] == ("", "alone")
    parquet = tmp_path / "t.parquet"
    assert run_sfhpc("traj", "export", str(run_dir), "--format", "parquet", "--out", str(parquet)).returncode == 0
    assert list(pd.read_parquet(parquet).set_index("id").loc[["solver-1", "alone"], "agent"]) == ["solver", ""]

    shown = run_sfhpc("traj", "show", str(run_dir), "checker-1")
    assert shown.returncode == 0, shown.stderr
    header = shown.stdout.splitlines()[0]
    # The agent's name is the program's choice: shown escaped, never as a terminal control sequence.
    assert "agent checker\\x1b[31m  episode ep-1" in header and "\x1b" not in shown.stdout, header
    alone = run_sfhpc("traj", "show", str(run_dir), "alone").stdout.splitlines()[0]
    assert "agent" not in alone and "episode" not in alone
