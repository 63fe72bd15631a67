"""The RL recipe stopped in every phase of its loop by every trigger, on the dev cluster (real slurmctld,
slurmdbd, slurmd, real MPI, real torch training): one job, nine allocations.

Phases: ``rollout`` (the controller waits for a batch), ``train`` (a training step) and ``broadcast``
(the new weights on their way to the engine). Triggers: ``scancel --signal=USR2`` (the run requeues
itself after its checkpoint), ``scontrol requeue`` (TERM; Slurm requeues the job) and a job on the
``urgent`` partition that preempts it (TERM; the run requeues itself). Each one checkpoints at the next
safe point and the next allocation goes on from that checkpoint.

``max_staleness: 0`` keeps one step's episodes out at a time, so every step has a rollout phase of its
own to aim at. The rollout engine is the deterministic test engine (``engine: {name: test}``, as the
acceptance allows for the phase matrix; the three triggers with vLLM are `test_slurm_preemption.py`).
It writes letters, so the reward stays 0: what is checked is the bookkeeping. ``SFHPC_HOLD_PHASES``
stretches the train and broadcast phases (`sfhpc.runtime.fault_injection`), and the test aims each
signal with the controller's live phase (``status.json``).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from sfhpc.data.store import open_store
from sfhpc.launch.jobs import job_status
from sfhpc.rl.checkpoints import RunCheckpoints, verify
from sfhpc.rl.live_status import read_live_status
from tests.conftest import run_sfhpc
from tests.launch.run_watch import read_events, resumed_in, running_in_restart, wait_until

pytestmark = [pytest.mark.slurm]

STEPS = 22
PHASES = ("rollout", "train", "broadcast")
RECIPE = f"""\
name: phases
seed: 5
engine: {{name: test, token_delay_s: 0.6}}
algorithm: {{group_size: 2}}
pipeline: {{mode: async, max_staleness: 0}}
budgets: {{steps: {STEPS}, prompts_per_step: 2}}
task: {{name: guess-number, options: {{max_turns: 3}}}}
roles:
  controller: {{place_with: trainer}}
  trainer:    {{tags: [train], nodes: 1}}
  rollout:    {{tags: [rollout], nodes: 1}}
training: {{checkpoint_every: 1}}
launch: {{time_minutes: 20, signal_grace_s: 60, max_restarts: 12}}
"""
HOLDS = "train=1,broadcast=1"


def just_entered(run_dir: Path, restart: int, phase: str) -> bool:
    """Allocation `restart` entered `phase` a moment ago (a signal takes ~0.1 s to reach the ranks)."""
    status = read_live_status(run_dir)
    return (status is not None and status["restart"] == restart and status["phase"] == phase
            and time.time() - status["since"] < 0.2)


def test_every_trigger_in_every_phase(slurm_cluster: str, tmp_path: Path) -> None:
    recipe = tmp_path / "phases.yaml"
    recipe.write_text(RECIPE + f"output_dir: {tmp_path / 'runs'}\n")
    done = run_sfhpc("launch", str(recipe), env={"SFHPC_HOLD_PHASES": HOLDS})
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = re.search(r"submitted job (\d+)", done.stdout).group(1)  # type: ignore[union-attr]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    triggers = {
        "usr2": ["scancel", "--signal=USR2", job_id],
        "requeue": ["scontrol", "requeue", job_id],
        "preempt": ["sbatch", "--partition=urgent", "--nodes=4", "--exclusive", "--time=1", "--job-name=urgent",
                    f"--output={tmp_path / 'urgent.out'}", "--wrap", "sleep 1"],
    }
    plan = [(trigger, phase) for trigger in triggers for phase in PHASES]
    cuts: list[dict] = []
    try:
        for restart, (trigger, phase) in enumerate(plan):
            wait_until(f"allocation {restart} to train", lambda r=restart: running_in_restart(run_dir, r, 1))
            wait_until(f"allocation {restart} in phase {phase}",
                       lambda r=restart, p=phase: just_entered(run_dir, r, p), timeout=90, poll_s=0.01)
            fired = time.time()
            subprocess.run(triggers[trigger], check=True, capture_output=True, text=True)
            cuts.append({"trigger": trigger, "phase": phase, "fired": fired, "status": read_live_status(run_dir)})
            wait_until(f"allocation {restart + 1} to resume", lambda r=restart: resumed_in(run_dir, r + 1))
        wait_until("the job to complete", lambda: job_status(job_id).state == "COMPLETED", timeout=600)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
        (tmp_path / "cuts.json").write_text(json.dumps(cuts, indent=1))

    events = read_events(run_dir)
    resumes = [e for e in events if e["event"] == "resumed"]
    assert [e["restart"] for e in resumes] == list(range(1, len(plan) + 1)), events
    # Each signal reached the ranks in the phase it was aimed at, the run stopped at its next safe point
    # (checkpoint of the step reached), and the next allocation went on from there.
    requested = {e["restart"]: e for e in events if e["event"] == "stop-requested"}
    stopped = {e["restart"]: e for e in events if e["event"] == "stopped"}
    for restart, (trigger, phase) in enumerate(plan):
        signal_name = "SIGUSR2" if trigger == "usr2" else "SIGTERM"
        assert (requested[restart]["signal"], requested[restart]["phase"]) == (signal_name, phase), cuts
        assert stopped[restart]["step"] == resumes[restart]["step"], events
    for resume in resumes:  # every restart continued from the newest checkpoint written before it
        earlier = [e["step"] for e in events if e["event"] == "checkpoint" and e["time"] < resume["time"]]
        assert resume["step"] == max(earlier), resume
    assert events[-1]["event"] == "finished" and events[-1]["step"] == STEPS

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # no step repeated, none missing
    assert [r["version"] for r in rows] == list(range(1, STEPS + 1))
    folders = RunCheckpoints(run_dir).folders()
    assert len(folders) == sum(e["event"] == "checkpoint" for e in events)
    for folder in folders:  # every earlier checkpoint is intact
        verify(folder)

    with open_store(run_dir / "trajectories.h5") as store:
        marks = store.marks()
        trajectories = list(store.trajectories())
    consumed = [m.trajectory_id for m in marks]
    assert len(consumed) == len(set(consumed))  # nothing trained twice
    last_start = resumes[-1]["time"] - resumes[-1]["seconds"]
    for t in trajectories:  # every trajectory of an earlier allocation was finished, continued or dropped
        if t.created < last_start:
            assert t.status in ("consumed", "finished", "stale", "aborted"), (t.id, t.status)
    # A trajectory cut by a stop was continued in a later allocation: segments on both sides of a restart.
    starts = [r["time"] - r["seconds"] for r in resumes]
    across = [t for t in trajectories if any(any(s.t_end < start for s in t.segments)
                                             and any(s.generated and s.t_start > start for s in t.segments)
                                             for start in starts)]
    assert across and sum(e["resumed"] for e in resumes) >= len(across)
