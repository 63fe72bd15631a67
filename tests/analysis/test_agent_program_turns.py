"""`turns` in the exports of an agent-program run: the replies `sfhpc traj show` numbers, not per-turn rewards.

An agent program reports no reward per turn, so a count of those exported 0 for every trajectory. The
store here is written as a run writes it: the real agent program (only the `openai` package) over HTTP
against the endpoint with the deterministic test engine, the real trajectory manager, the real HDF5 store.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

from sfhpc.analysis import open_run
from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.store import TrajectoryStore
from sfhpc.endpoint import AgentEndpoint, EndpointServer, OpenAIApi, new_run_token
from sfhpc.engine.scripted import ScriptedEngine
from tests.conftest import run_sfhpc
from tests.rollout.test_agent_process import MODEL, play, programs

TURNS = 3


def test_exported_turns_are_the_replies_traj_show_shows(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    manager = TrajectoryManager(TrajectoryStore.create(run_dir / "trajectories.h5"))
    engine = ScriptedEngine(seed=3, vocab=tuple(range(ord("0"), ord("9") + 1)), max_model_len=256)
    api = OpenAIApi(AgentEndpoint(engine, manager), model_name=MODEL, token=new_run_token())
    with EndpointServer(api) as server:
        # A secret no one-digit guess finds: the program asks exactly --turns times.
        outcome = play(server, manager, programs(server, "--turns", str(TURNS)), 10)
    assert outcome is not None
    tid = outcome.trajectory_id
    assert manager.trajectory(tid).turn_rewards == ()  # the program reported none per turn
    manager.close()

    shown = run_sfhpc("traj", "show", str(run_dir), tid)
    assert shown.returncode == 0, shown.stderr
    replies = re.findall(r"\(reply (\d+)\)", shown.stdout)
    assert replies == [str(n) for n in range(1, TURNS + 1)]

    out = tmp_path / "t.csv"
    done = run_sfhpc("traj", "export", str(run_dir), "--out", str(out))
    assert done.returncode == 0, done.stderr
    (row,) = csv.DictReader(out.open(encoding="utf-8"))
    assert (row["id"], row["turns"]) == (tid, str(TURNS))
    jsonl = tmp_path / "t.jsonl"
    # The format follows --out's suffix unless --format names one.
    assert run_sfhpc("traj", "export", str(run_dir), "--out", str(jsonl)).returncode == 0
    assert json.loads(jsonl.read_text())["turns"] == TURNS
    with open_run(run_dir) as run:
        assert list(run.trajectories()["turns"]) == [TURNS]
        assert len(run.turns()) == TURNS  # one row per reply in the turns frame too
