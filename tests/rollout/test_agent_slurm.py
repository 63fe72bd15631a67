"""An agent program inside an RL run on the dev cluster: `sfhpc launch` of a recipe with `agent.command`,
trainer and rollout on different partitions, the program started per episode on the rollout node."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sfhpc.data.store import open_store
from tests.conftest import run_sfhpc
from tests.rollout.test_agent_run import agent_recipe, check_agent_run

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]


def test_an_agent_program_plays_inside_a_slurm_run(slurm_cluster: str, tmp_path: Path) -> None:
    recipe = agent_recipe(tmp_path)
    recipe.write_text(recipe.read_text() + "launch: {time_minutes: 10}\n")
    done = run_sfhpc("launch", str(recipe), "--wait", "--timeout", "600", timeout=660)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    report = json.loads((run_dir / "launch_report.json").read_text())
    rollout = next(r for r in report["ranks"] if r["roles"] == ["rollout"])
    check_agent_run(run_dir, tmp_path / "faults")
    with open_store(run_dir / "trajectories.h5") as store:
        engines = {s.engine for t in store.trajectories(status="consumed") for s in t.segments if s.generated}
    assert engines == {f"vllm-r{rollout['rank']}"}  # every call of the programs went to the rollout node's engine
