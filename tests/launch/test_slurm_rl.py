"""The RL recipe under `sfhpc launch` on the dev cluster: trainer and rollout on different partitions, one
MPI world across the het components, vLLM on the rollout node, the store in the run folder."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sfhpc.data.store import open_store
from tests.conftest import run_sfhpc
from tests.launch.test_slurm_jobs import het_completed, node_features, wait_for_sacct

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]

RECIPE = """\
name: rl-on-slurm
model: {warm_start_steps: 5}
algorithm: {group_size: 4}
pipeline: {mode: async, max_staleness: 1}
budgets: {steps: 3, prompts_per_step: 4}
task: {name: next-letter}
roles:
  controller: {place_with: trainer}
  trainer:    {tags: [train], nodes: 1}
  rollout:    {tags: [rollout], nodes: 1}
launch: {time_minutes: 15}
"""


def test_rl_recipe_runs_across_partitions(slurm_cluster: str, tmp_path: Path) -> None:
    recipe = tmp_path / "rl.yaml"
    recipe.write_text(RECIPE + f"output_dir: {tmp_path / 'runs'}\n")
    done = run_sfhpc("launch", str(recipe), "--wait", "--timeout", "900", timeout=960)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    job_id = re.search(r"submitted job (\d+)", done.stdout).group(1)  # type: ignore[union-attr]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    report = json.loads((run_dir / "launch_report.json").read_text())
    features = node_features(slurm_cluster)
    placed = [(r["roles"], r["component"], "train" in features[r["node"]], "rollout" in features[r["node"]])
              for r in report["ranks"]]
    assert placed == [(["controller"], 0, True, False), (["trainer"], 0, True, False), (["rollout"], 1, False, True)]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2, 3]
    with open_store(run_dir / "trajectories.h5") as store:
        consumed = list(store.trajectories(status="consumed"))
        assert len(consumed) == 3 * 4 * 4
        engines = {s.engine for t in consumed for s in t.segments if s.generated}
        assert engines == {"vllm-r2"}  # every generated token came from the engine on the rollout node
    assert wait_for_sacct(job_id, het_completed(job_id, 2)) == het_completed(job_id, 2)
