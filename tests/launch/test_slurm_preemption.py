"""The RL recipe outlives its allocations on the dev cluster (real slurmctld/slurmdbd/slurmd, real MPI, real
vLLM): one job is stopped four times, by each trigger a site uses, and finishes its steps.

1. ``scancel --signal=USR2`` (reaches the ranks): checkpoint at the safe point, the run requeues itself;
2. ``scancel -b --signal=USR1`` (what ``--signal=B:USR1@N`` does before the time limit: the batch shell
   only, which passes it on): the same;
3. ``scontrol requeue`` and 4. a job on the ``urgent`` partition that preempts it (PreemptMode=REQUEUE):
   TERM reaches every process of the step, vLLM's engine processes included (which ignore it), and the
   ranks checkpoint at the safe point within Slurm's grace; the preempted run requeues itself (Slurm 22.05
   would not requeue a heterogeneous job that ended inside the grace time).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from sfhpc.data.store import open_store
from sfhpc.launch.jobs import job_status
from sfhpc.rl.checkpoints import RunCheckpoints, verify
from tests.conftest import run_sfhpc
from tests.launch.run_watch import read_events, resumed_in, running_in_restart, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]

STEPS = 24
RECIPE = f"""\
name: outlive
seed: 11
model: {{warm_start_steps: 5}}
algorithm: {{group_size: 4}}
pipeline: {{mode: async, max_staleness: 1}}
budgets: {{steps: {STEPS}, prompts_per_step: 4}}
task: {{name: guess-number, options: {{max_turns: 4}}}}
roles:
  controller: {{place_with: trainer}}
  trainer:    {{tags: [train], nodes: 1}}
  rollout:    {{tags: [rollout], nodes: 1}}
training: {{checkpoint_every: 2}}
launch: {{time_minutes: 20, signal_grace_s: 60}}
"""


def test_the_rl_run_survives_usr2_usr1_requeue_and_preemption(slurm_cluster: str, tmp_path: Path) -> None:
    recipe = tmp_path / "outlive.yaml"
    recipe.write_text(RECIPE + f"output_dir: {tmp_path / 'runs'}\n")
    done = run_sfhpc("launch", str(recipe))
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = re.search(r"submitted job (\d+)", done.stdout).group(1)  # type: ignore[union-attr]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    triggers = [
        ["scancel", "--signal=USR2", job_id],
        ["scancel", "--batch", "--signal=USR1", job_id],
        ["scontrol", "requeue", job_id],
        ["sbatch", "--partition=urgent", "--nodes=4", "--exclusive", "--time=1", "--job-name=urgent",
         f"--output={tmp_path / 'urgent.out'}", "--wrap", "sleep 2"],
    ]
    try:
        for restart, command in enumerate(triggers):
            wait_until(f"allocation {restart} to train", lambda r=restart: running_in_restart(run_dir, r))
            subprocess.run(command, check=True, capture_output=True, text=True)
            wait_until(f"allocation {restart + 1} to resume", lambda r=restart: resumed_in(run_dir, r + 1))
        wait_until("the job to complete", lambda: job_status(job_id).state == "COMPLETED", timeout=600)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)

    events = read_events(run_dir)
    stops = [(e["restart"], e["signal"]) for e in events if e["event"] == "stopped"]
    # Every trigger was met at the safe point: a checkpoint of the step reached, and the next run went on from it.
    assert stops == [(0, "SIGUSR2"), (1, "SIGUSR1"), (2, "SIGTERM"), (3, "SIGTERM")], events
    resumes = [e for e in events if e["event"] == "resumed"]
    assert [e["restart"] for e in resumes] == [1, 2, 3, 4]
    stopped_steps = [e["step"] for e in events if e["event"] == "stopped"]
    assert [e["step"] for e in resumes] == stopped_steps  # went on from the stop checkpoint
    checkpoint_steps = [e["step"] for e in events if e["event"] == "checkpoint"]
    for resume in resumes:  # always from the newest checkpoint written before it
        earlier = [e["step"] for e in events if e["event"] == "checkpoint" and e["time"] < resume["time"]]
        assert resume["step"] == max(earlier), (resume, checkpoint_steps)
    assert events[-1]["event"] == "finished" and events[-1]["step"] == STEPS

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # no step repeated, none missing
    assert [r["version"] for r in rows] == list(range(1, STEPS + 1))
    discarded = run_dir / "metrics-discarded.jsonl"
    redone = len(discarded.read_text().splitlines()) if discarded.exists() else 0
    assert redone == 0  # every stop came at a safe point: no step was trained twice
    folders = RunCheckpoints(run_dir).folders()
    for folder in folders:  # every earlier checkpoint is intact
        verify(folder)
    assert len(folders) == len(checkpoint_steps)

    cut_times = [e["time"] for e in events if e["event"] == "stop-requested"]
    with open_store(run_dir / "trajectories.h5") as store:
        marks = store.marks()
        trajectories = list(store.trajectories())
    consumed = [m.trajectory_id for m in marks]
    assert len(consumed) == len(set(consumed))  # nothing trained twice
    # Every step consumed one whole batch; a step trained after the last checkpoint of a killed allocation
    # (its weights lost) keeps its marks, so its trajectories are never trained again either.
    assert len(consumed) % (4 * 4) == 0 and len(consumed) >= (STEPS + redone) * 4 * 4
    # Trajectories that went on across a restart: a segment from before a stop request, and generated tokens
    # from after the next allocation started resuming (an async run keeps generating between the request and
    # its safe point, so the request's own time is not the cut).
    restarts = [(cut, next(r["time"] - r["seconds"] for r in resumes if r["time"] > cut)) for cut in cut_times]
    across = [t for t in trajectories if any(
        any(s.t_end < cut for s in t.segments) and any(s.generated and s.t_start > back for s in t.segments)
        for cut, back in restarts)]
    assert sum(e["resumed"] for e in resumes) >= len(across)
    for t in trajectories:  # nothing is left open but the look-ahead of the last allocation
        if t.created < resumes[-1]["time"] - resumes[-1]["seconds"]:
            assert t.status in ("consumed", "finished", "stale", "aborted"), (t.id, t.status)

    status = run_sfhpc("status", job_id, "--output-dir", str(tmp_path / "runs"))
    assert status.returncode == 0 and re.search(r"restarts?\D+4", status.stdout), status.stdout
