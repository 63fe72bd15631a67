"""An agent program inside an RL run on the dev cluster, under `sfhpc launch` (real Slurm, real MPI, real
vLLM, real training): one heterogeneous job, the controller and trainer on a node of the ``train``
partition, the rollout rank with vLLM on a node of the ``rollout`` partition, one MPI world across the two
components, the store in the run folder, and the program started per episode on the rollout node; one of
its episodes crashes and one hangs, and the run still trains its whole budget (`check_agent_run`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sfhpc.data.store import open_store
from tests.conftest import run_sfhpc
from tests.launch.test_slurm_jobs import het_completed, node_features, wait_for_sacct
from tests.rollout.test_agent_run import agent_recipe, check_agent_run

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]


def test_an_agent_program_plays_inside_a_slurm_run(slurm_cluster: str, tmp_path: Path) -> None:
    recipe = agent_recipe(tmp_path)
    recipe.write_text(recipe.read_text() + "launch: {time_minutes: 10}\n")
    done = run_sfhpc("launch", str(recipe), "--wait", "--timeout", "600", timeout=660)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    job_id = re.search(r"submitted job (\d+)", done.stdout).group(1)  # type: ignore[union-attr]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    report = json.loads((run_dir / "launch_report.json").read_text())
    features = node_features(slurm_cluster)
    placed = [(r["roles"], r["component"], "train" in features[r["node"]], "rollout" in features[r["node"]])
              for r in report["ranks"]]
    assert placed == [(["controller"], 0, True, False), (["trainer"], 0, True, False), (["rollout"], 1, False, True)]
    # One MPI world across the het components: the launch report's Allgather reached every rank of both.
    assert report["allgather_rank_component"] == [[0, 0], [1, 0], [2, 1]]
    assert all(r["job_id"] == job_id and r["launcher"] == "slurm" for r in report["ranks"])
    check_agent_run(run_dir, tmp_path / "faults")
    with open_store(run_dir / "trajectories.h5") as store:  # the store the run folder holds
        engines = {s.engine for t in store.trajectories(status="consumed") for s in t.segments if s.generated}
    assert engines == {"vllm-r2"}  # every call of the programs went to the engine on the rollout node
    assert wait_for_sacct(job_id, het_completed(job_id, 2)) == het_completed(job_id, 2)
