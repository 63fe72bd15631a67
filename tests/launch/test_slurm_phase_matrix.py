"""The RL recipe stopped in every phase of its loop by every signal a rank acts on, on the dev cluster (real
slurmctld, slurmdbd, slurmd, real MPI, real torch training): one job, seven allocations.

Phases: ``rollout`` (the controller waits for a batch), ``train`` (a training step) and ``broadcast``
(the new weights on their way to the engine). A rank acts on two kinds of signal: USR1 and USR2 (the run
requeues itself after its checkpoint) and TERM (Slurm requeues the job, or a preemption ends it and the run
requeues itself); each kind is sent in every phase, by every trigger: ``scancel --signal=USR2`` (train,
broadcast), ``scancel --batch --signal=USR1`` (what ``--signal=B:USR1@N`` does ahead of the time limit: the
batch shell alone gets it and passes it on; rollout), ``scontrol requeue`` (rollout, broadcast) and a job on
the ``urgent`` partition that preempts it (train). Each one checkpoints at the next safe point and the next
allocation goes on from that checkpoint. With vLLM, `test_slurm_preemption.py`.

``max_staleness: 0`` keeps one step's episodes out at a time, so every step has a rollout phase of its
own to aim at. The rollout engine is the deterministic test engine (``engine: {name: test}``), paced so
that a step's episodes take seconds. It writes letters, so the reward stays 0: what is checked is the
bookkeeping. ``SFHPC_HOLD_PHASES`` stretches the train and broadcast phases
(`sfhpc.runtime.fault_injection`), and the test aims each signal with the controller's live phase
(``status.json``): an allocation is cut in the first step it plays, so a cut in the rollout phase trains
nothing and one in the train or broadcast phase trains one step.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from sfhpc.data.store import open_store
from sfhpc.rl.checkpoints import RunCheckpoints, verify
from tests.conftest import run_sfhpc
from tests.launch.run_watch import in_phase, job_end_state, read_events, resumed_after, wait_until

pytestmark = [pytest.mark.slurm]

# (trigger, phase) of each allocation but the last, in order. The first cut trains step 1 (a cut in the
# rollout phase of a first allocation would checkpoint before any step).
# Both kinds of signal a rank acts on (USR1/USR2: the run requeues itself; TERM: Slurm requeues or preempts)
# in every phase, every trigger at least once: what differs between triggers of one kind is their path, not
# how a phase stops (each allocation costs about 25 s here).
PLAN = (("usr2", "train"), ("usr2", "broadcast"), ("usr1", "rollout"),
        ("requeue", "rollout"), ("requeue", "broadcast"), ("preempt", "train"))
SIGNALS = {"usr2": "SIGUSR2", "usr1": "SIGUSR1", "requeue": "SIGTERM", "preempt": "SIGTERM"}
# One step per train or broadcast cut (4), then the last allocation's own: two, which a cut that misses its
# moment (the test saw the phase late) and waits for the next step's may use instead.
STEPS = 6
RECIPE = f"""\
name: phases
seed: 5
engine: {{name: test, token_delay_s: 0.25}}
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
HOLDS = "train=1.5,broadcast=1.5"
# A signal is sent at most this long after its phase began: it reaches the ranks well inside the 1.5 s of a
# held phase, and inside a rollout phase (a step's episodes, seconds at 0.25 s a token).
AIM_S = 0.3


def test_every_trigger_in_every_phase(slurm_cluster: str, tmp_path: Path) -> None:
    recipe = tmp_path / "phases.yaml"
    recipe.write_text(RECIPE + f"output_dir: {tmp_path / 'runs'}\n")
    done = run_sfhpc("launch", str(recipe), env={"SFHPC_HOLD_PHASES": HOLDS})
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = re.search(r"submitted job (\d+)", done.stdout).group(1)  # type: ignore[union-attr]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    triggers = {
        "usr2": ["scancel", "--signal=USR2", job_id],
        "usr1": ["scancel", "--batch", "--signal=USR1", job_id],
        "requeue": ["scontrol", "requeue", job_id],
        "preempt": ["sbatch", "--partition=urgent", "--nodes=4", "--exclusive", "--time=1", "--job-name=urgent",
                    f"--output={tmp_path / 'urgent.out'}", "--wrap", "sleep 1"],
    }
    cuts: list[dict] = []
    # The allocation each cut is aimed at: Slurm's restart count. An allocation whose step fails before the run
    # starts (a rank that crashed on start) is requeued by the run itself, and the count moves on past it.
    allocations = [0]
    try:
        resumed_step = 0
        for cut, (trigger, phase) in enumerate(PLAN):
            if cut:
                # Polled closely: a rollout cut aims at the rollout phase that begins as the allocation resumes.
                resumed = wait_until(f"the allocation after {allocations[-1]} to resume",
                                     lambda a=allocations[-1]: resumed_after(run_dir, a), timeout=600, poll_s=0.02)
                resumed_step = resumed["step"]  # type: ignore[index]
                allocations.append(resumed["restart"])  # type: ignore[index]
            restart = allocations[-1]
            aimed = wait_until(f"allocation {restart} in phase {phase}",
                               lambda r=restart, p=phase, s=resumed_step: in_phase(run_dir, r, p, s, AIM_S),
                               timeout=600 if restart == 0 else 300, poll_s=0.01)  # the first builds the model
            fired = time.time()
            subprocess.run(triggers[trigger], check=True, capture_output=True, text=True)
            cuts.append({"trigger": trigger, "phase": phase, "fired": fired, "aimed": aimed})
        wait_until(f"the allocation after {allocations[-1]} to resume",
                   lambda: resumed_after(run_dir, allocations[-1]), timeout=600)
        state = wait_until("the job to end", lambda: job_end_state(job_id), timeout=900, poll_s=1)
        assert state == "COMPLETED", state
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
        (tmp_path / "cuts.json").write_text(json.dumps(cuts, indent=1))

    events = read_events(run_dir)
    resumes = [e for e in events if e["event"] == "resumed"]
    assert [e["restart"] for e in resumes] == allocations[1:] + [resumes[-1]["restart"]], events
    # A restart count skipped is an allocation whose step failed on start, which the batch log names.
    log = "".join(p.read_text(errors="replace") for p in run_dir.glob("slurm-*.out"))
    assert log.count("sfhpc: the step failed") == resumes[-1]["restart"] - len(PLAN), events
    # Each signal reached the ranks in the phase it was aimed at, the run stopped at its next safe point
    # (checkpoint of the step reached), and the next allocation went on from there.
    requested = {e["restart"]: e for e in events if e["event"] == "stop-requested"}
    stopped = {e["restart"]: e for e in events if e["event"] == "stopped"}
    for cut, (trigger, phase) in enumerate(PLAN):
        restart = allocations[cut]
        assert (requested[restart]["signal"], requested[restart]["phase"]) == (SIGNALS[trigger], phase), cuts
        # A step cut while it trains or sends its weights is finished first; one cut while it waits for its
        # episodes is not trained.
        aimed_step = cuts[cut]["aimed"]["step"]
        assert stopped[restart]["step"] == (aimed_step - 1 if phase == "rollout" else aimed_step), cuts
        assert stopped[restart]["step"] == resumes[cut]["step"], events
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
    # A trajectory cut by a stop was continued in a later allocation: segments on both sides of a restart
    # (a reply continued after a restart keeps its first start).
    starts = [r["time"] - r["seconds"] for r in resumes]
    across = [t for t in trajectories if any(any(s.t_end < start for s in t.segments)
                                             and any(s.generated and s.t_end > start for s in t.segments)
                                             for start in starts)]
    assert across and sum(e["resumed"] for e in resumes) >= len(across)
