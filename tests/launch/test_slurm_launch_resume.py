"""`sfhpc launch --resume`: a run whose job was cancelled goes on in a new job, in its own folder, on the real
dev cluster: its steps continue from the stop's checkpoint, each once, and nothing is trained twice. While a
job of the run still runs, and once the run is complete, the command refuses in one line and submits
nothing."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import pytest

from sfhpc.data.store import open_store
from sfhpc.launch.jobs import FINAL_STATES
from sfhpc.runtime.slurm_job import live_job
from tests.conftest import assert_one_line_error, run_sfhpc
from tests.launch.run_watch import job_end_state, jsonl, read_events, wait_until

pytestmark = pytest.mark.slurm

STEPS = 6
RECIPE = f"""\
name: goes-on
seed: 2
engine: {{name: test}}
model: {{build: {{layers: 1, hidden_size: 64, heads: 1}}}}
algorithm: {{group_size: 2}}
pipeline: {{mode: async, max_staleness: 1}}
budgets: {{steps: {STEPS}, prompts_per_step: 2}}
task: {{name: next-letter}}
training: {{checkpoint_every: 2}}
roles:
  controller: {{place_with: trainer}}
  trainer:    {{tags: [train], nodes: 1}}
  rollout:    {{tags: [rollout], nodes: 1}}
launch: {{time_minutes: 10}}
"""
HOLD = {"SFHPC_HOLD_PHASES": "train=1"}  # a second a step: the cancel lands mid-run


def holding(job_id: str) -> bool:
    live = live_job(job_id)
    return live is not None and live.state.split()[0] not in FINAL_STATES


def test_a_cancelled_run_goes_on_in_a_new_job(slurm_cluster: str, tmp_path: Path) -> None:
    recipe = tmp_path / "goes-on.yaml"
    recipe.write_text(RECIPE + f"output_dir: {tmp_path / 'runs'}\n")
    done = run_sfhpc("launch", str(recipe), env=HOLD)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    first = re.search(r"submitted job (\d+)", done.stdout).group(1)  # type: ignore[union-attr]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    second = None
    try:
        wait_until("step 2's checkpoint", lambda: (run_dir / "checkpoints" / "step-000002" / "MANIFEST.json").exists(),
                   timeout=300, poll_s=0.1)
        # The job still runs: a second one would write the same store.
        assert_one_line_error(run_sfhpc("launch", str(recipe), "--resume", str(run_dir)),
                              f"job {first} of this run is", f"sfhpc cancel {first}")
        assert run_sfhpc("cancel", first).returncode == 0
        state = wait_until("the job to end", lambda: job_end_state(first), timeout=120)
        assert str(state).startswith("CANCELLED"), state
        # slurmctld holds it COMPLETING until its last process is gone (the refusal above says so meanwhile).
        wait_until("the job's processes to end", lambda: not holding(first), timeout=120)
        cut_at = [r["step"] for r in jsonl(run_dir / "metrics.jsonl")]
        assert 2 <= len(cut_at) < STEPS, cut_at

        again = run_sfhpc("launch", str(recipe), "--resume", str(run_dir), "--wait", "--timeout", "300", env=HOLD,
                          timeout=400)
        submitted = re.search(r"submitted job (\d+)", again.stdout)
        second = submitted.group(1) if submitted else None
        assert again.returncode == 0 and second is not None, again.stdout[-3000:] + again.stderr[-3000:]
        assert f"run folder {run_dir}" in again.stdout
    finally:
        run_sfhpc("cancel", first)
        if second is not None:
            run_sfhpc("cancel", second)

    rows = jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # the steps went on, each once
    events = read_events(run_dir)
    resumed = [e for e in events if e["event"] == "resumed"]
    assert [e["job"] for e in resumed] == [second] and resumed[0]["step"] >= 2
    assert {e["job"] for e in events} == {first, second}
    assert events[-1]["event"] == "finished" and events[-1]["step"] == STEPS and events[-1]["job"] == second
    with open_store(run_dir / "trajectories.h5") as store:
        marks = list(store.marks())
    trained = collections.Counter(m.trajectory_id for m in marks)
    assert trained and max(trained.values()) == 1  # nothing trained twice
    assert sorted({m.step for m in marks}) == list(range(1, STEPS + 1))
    # The run is complete: a job that would find nothing to do is not submitted.
    assert_one_line_error(run_sfhpc("launch", str(recipe), "--resume", str(run_dir)), "the run is complete",
                          "raise budgets.steps")
    assert sorted(p.name for p in run_dir.glob("slurm-*.out")) == sorted([f"slurm-{first}.out", f"slurm-{second}.out"])
