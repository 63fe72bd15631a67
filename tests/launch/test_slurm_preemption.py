"""The RL recipe outlives its allocations on the dev cluster (real slurmctld/slurmdbd/slurmd, real MPI, real
vLLM): one job is stopped four times, by each trigger a site uses, and finishes its steps.

1. ``scancel --signal=USR2`` (reaches the ranks): checkpoint at the safe point, the run requeues itself;
2. ``scancel -b --signal=USR1`` (what ``--signal=B:USR1@N`` does before the time limit: the batch shell
   only, which passes it on): the same;
3. ``scontrol requeue`` and 4. a job on the ``urgent`` partition that preempts it (PreemptMode=REQUEUE):
   on this cluster (Slurm 22.05, mpi/pmix) the step is ended before the ranks reach a safe point (srun
   gets the TERM too and terminates the step), so the run resumes from its last complete checkpoint
   (``training.checkpoint_every``); steps trained after it are trained again on new trajectories.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sfhpc.data.store import open_store
from sfhpc.launch.jobs import job_status
from sfhpc.rl.checkpoints import RunCheckpoints, verify
from tests.conftest import run_sfhpc

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


def wait_until(what: str, probe: Callable[[], object], timeout: float = 420) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := probe():
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def read_events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def steps_in(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def running_in_restart(run_dir: Path, restart: int, own_steps: int = 2) -> bool:
    """Allocation `restart` trains (it resumed, if a restart) and has done `own_steps` steps of its own."""
    events = read_events(run_dir)
    if any(e["event"] == "stop-requested" and e["restart"] == restart for e in events):
        return False
    if restart == 0:
        return steps_in(run_dir) >= own_steps
    resumed = next((e for e in events if e["event"] == "resumed" and e["restart"] == restart), None)
    return resumed is not None and steps_in(run_dir) >= resumed["step"] + own_steps


def resumed_in(run_dir: Path, restart: int) -> dict | None:
    return next((e for e in read_events(run_dir) if e["event"] == "resumed" and e["restart"] == restart), None)


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
    assert stops[:2] == [(0, "SIGUSR2"), (1, "SIGUSR1")], events  # checkpointed at the safe point
    resumes = [e for e in events if e["event"] == "resumed"]
    assert [e["restart"] for e in resumes] == [1, 2, 3, 4]
    stopped_steps = [e["step"] for e in events if e["event"] == "stopped"]
    assert [e["step"] for e in resumes[:2]] == stopped_steps[:2]  # went on from the stop checkpoint
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
