"""The RL recipe with vLLM outlives a crash and a preemption on the dev cluster (real slurmctld, slurmdbd,
slurmd, real MPI, real vLLM): one job, three allocations.

1. A rank killed outright (``kill -9``: no signal handler, no checkpoint): the vLLM rank, whose engine
   processes end with it (they ignore stop signals; the engine's watchdog kills them). srun's
   ``--kill-on-bad-exit`` ends the step; the batch script's step guard sees a failed step with no signal
   from outside and requeues the job (``--requeue-on-failure``); the next allocation finds the newest sound
   checkpoint (a periodic one), moves the metrics of the steps trained after it to
   ``metrics-discarded.jsonl`` and trains them again. The store survives the kill (flushed per batch,
   SWMR): every trajectory it held right after the step died is still there, with at least those tokens.
2. A job on the ``urgent`` partition preempts it (PreemptMode=REQUEUE) while it generates the first batch of
   the next allocation: TERM reaches every process of the step, vLLM's engine processes included (which
   ignore it), the ranks checkpoint at the safe point within Slurm's grace and record the generations in
   flight as partial rollouts, and the preempted run requeues itself (Slurm 22.05 would not requeue a
   heterogeneous job that ended inside the grace time). The last allocation continues those trajectories
   from their prefix and trains on them.

``max_staleness: 0`` keeps one step's episodes out at a time: a step's rollout phase is the generation of
its whole batch, so a preemption aimed at it finds generations in flight whatever the machine's speed (with
a staleness bound, vLLM may have finished the next batch before the step that waits for it begins).

The other triggers (``scancel --signal=USR2``, ``scancel --batch --signal=USR1``, ``scontrol requeue``)
and the phase a signal lands in are `test_slurm_phase_matrix.py`'s, on the test engine.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from sfhpc.data.store import open_store
from sfhpc.launch.jobs import job_restarts
from sfhpc.rl.checkpoints import RunCheckpoints, verify
from tests.conftest import run_sfhpc
from tests.launch.run_watch import (
    alive,
    descendants,
    in_phase,
    job_end_state,
    jsonl,
    rank_processes,
    read_events,
    resumed_in,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]

KILL_AFTER = 3  # steps done; the newest checkpoint is then step 2 (checkpoint_every: 2), so step 3 is redone
# The preemption cuts the first step of the second allocation (step 3, trained by none); the last allocation
# trains the cut trajectories' groups at once (step 3: one step's groups are out at a time), then one step.
STEPS = KILL_AFTER + 1
GROUPS, GROUP_SIZE = 2, 4
RECIPE = f"""\
name: outlive
seed: 11
model: {{build: {{warm_start_steps: 5}}}}
algorithm: {{group_size: {GROUP_SIZE}}}
pipeline: {{mode: async, max_staleness: 0}}
budgets: {{steps: {STEPS}, prompts_per_step: {GROUPS}}}
task: {{name: guess-number, options: {{max_turns: 8}}}}  # most episodes play 8 turns: a long rollout phase
roles:
  controller: {{place_with: trainer}}
  trainer:    {{tags: [train], nodes: 1}}
  rollout:    {{tags: [rollout], nodes: 1}}
training: {{checkpoint_every: 2}}
launch: {{time_minutes: 20, signal_grace_s: 60}}
"""
GRACE_S = 5  # the dev cluster's partitions' GraceTime (scripts/devcluster.sh)
ROLLOUT_RANK = 2  # controller 0 and trainer 1 on the train node, rollout 2 (vLLM) on the rollout node


def trajectory_sizes(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Trajectory id -> (tokens, tokens of its segments), read while or after the run writes (SWMR)."""
    with open_store(run_dir / "trajectories.h5") as store:
        return {t.id: (t.num_tokens, sum(len(s) for s in t.segments)) for t in store.trajectories()}


def test_the_rl_run_outlives_a_kill_and_a_preemption(slurm_cluster: str, tmp_path: Path) -> None:
    recipe = tmp_path / "outlive.yaml"
    recipe.write_text(RECIPE + f"output_dir: {tmp_path / 'runs'}\n")
    # Every training step held 2 s (`sfhpc.runtime.fault_injection`): the kill after KILL_AFTER steps lands while
    # the last step trains, however fast its episodes were (steps of 1.3 s had once finished the run before it).
    done = run_sfhpc("launch", str(recipe), env={"SFHPC_HOLD_PHASES": "train=2"})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    job_id = re.search(r"submitted job (\d+)", done.stdout).group(1)  # type: ignore[union-attr]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    metrics = run_dir / "metrics.jsonl"
    log = run_dir / f"slurm-{job_id}.out"
    try:
        # Allocation 0 trains KILL_AFTER steps (it builds and warm-starts the model first); its vLLM rank dies.
        wait_until(f"{KILL_AFTER} steps", lambda: len(jsonl(metrics)) >= KILL_AFTER, timeout=600, poll_s=0.1)
        ranks = rank_processes(run_dir)
        assert sorted(ranks) == [0, 1, ROLLOUT_RANK], ranks
        engine = descendants(ranks[ROLLOUT_RANK])  # vLLM's engine core and worker, the engine's watchdog
        assert engine, "the rollout rank runs no engine process"
        os.kill(ranks[ROLLOUT_RANK], signal.SIGKILL)
        # The step is over once no rank of this run is left (srun's --kill-on-bad-exit ended the others), and
        # no process the killed rank started is left either: vLLM's, which ignore stop signals, would
        # otherwise hold the step's output (and their memory) for good.
        wait_until("the step to end", lambda: not rank_processes(run_dir), timeout=120, poll_s=0.1)
        wait_until("the killed rank's engine processes to end", lambda: not any(map(alive, engine)), timeout=60)
        steps_at_kill = [r["step"] for r in jsonl(metrics)]
        latest = RunCheckpoints(run_dir).latest()
        held = trajectory_sizes(run_dir)  # SWMR: the writer was killed with the file open

        # Allocation 1 resumes from the periodic checkpoint and is preempted while it generates its first batch.
        resumed = wait_until("allocation 1 to resume", lambda: resumed_in(run_dir, 1), timeout=600, poll_s=0.05)
        resumed_step = resumed["step"]  # type: ignore[index]
        wait_until(f"allocation 1 in the rollout phase of step {resumed_step + 1}",
                   lambda: in_phase(run_dir, 1, "rollout", resumed_step, within_s=1.0), timeout=120, poll_s=0.02)
        subprocess.run(["sbatch", "--partition=urgent", "--nodes=4", "--exclusive", "--time=1", "--job-name=urgent",
                        f"--output={tmp_path / 'urgent.out'}", "--wrap", "sleep 1"],
                       check=True, capture_output=True, text=True)
        wait_until("allocation 2 to resume", lambda: resumed_in(run_dir, 2), timeout=600)
        state = wait_until("the job to end", lambda: job_end_state(job_id), timeout=900, poll_s=1)
        assert state == "COMPLETED", log.read_text()[-6000:] if log.exists() else state
    finally:
        run_sfhpc("cancel", job_id)  # nothing is left running, whatever failed (a no-op once it completed)

    events = read_events(run_dir)
    checkpoints = [e for e in events if e["event"] == "checkpoint"]
    resumes = [e for e in events if e["event"] == "resumed"]
    assert [e["restart"] for e in resumes] == [1, 2], events
    for resume in resumes:  # always from the newest checkpoint written before it
        assert resume["step"] == max(e["step"] for e in checkpoints if e["time"] < resume["time"]), events

    # The kill: the newest periodic checkpoint (one being written at the kill, a hidden .partial folder, is
    # not one) is where the next allocation went on, the steps after it trained again, nothing of the store
    # lost.
    assert steps_at_kill[:KILL_AFTER] == list(range(1, KILL_AFTER + 1)), steps_at_kill
    assert latest is not None and latest.step % 2 == 0 and 2 <= latest.step < steps_at_kill[-1], steps_at_kill
    assert resumes[0]["step"] == latest.step
    assert held, "the store held nothing after the kill"
    assert not any(e["event"] == "stop-requested" for e in events if e["restart"] == 0)  # no signal, no stop
    discarded = [r["step"] for r in jsonl(run_dir / "metrics-discarded.jsonl")]
    assert discarded == [s for s in steps_at_kill if s > latest.step]  # trained by weights the kill lost
    log_text = log.read_text()
    guard_line = rf"the step failed \(exit \d+\); requeueing job {job_id} \(restart 1 of"  # the step guard's
    assert re.search(guard_line, log_text), log_text[-6000:]

    # The preemption: TERM met in the rollout phase, a checkpoint at the safe point, the generations in flight
    # recorded as partial rollouts and continued by the next allocation, which went on from that checkpoint;
    # the run requeued itself.
    requested = [e for e in events if e["event"] == "stop-requested"]
    assert [(e["restart"], e["signal"], e["phase"]) for e in requested] == [(1, "SIGTERM", "rollout")], events
    stops = [e for e in events if e["event"] == "stopped"]
    assert [(e["restart"], e["step"]) for e in stops] == [(1, resumed_step)], events
    assert resumes[1]["step"] == resumed_step
    quiesced = [e["interrupted"] for e in events if e["event"] == "quiesced" and e["restart"] == 1]
    assert quiesced and quiesced[0] > 0, events  # generations cut in flight
    assert resumes[1]["resumed"] > 0, resumes[1]  # trajectories continued from their prefix
    # Who requeued the job: ended within the grace time, a heterogeneous job is not requeued by Slurm 22.05,
    # so the run asks for it itself; a loaded machine can reach the safe point only after the grace time,
    # and then Slurm's kill requeues the job and the run finds it no longer being preempted.
    asked = any(e["event"] == "requeue-requested" and e["restart"] == 1 for e in events)
    assert asked or stops[0]["time"] - requested[0]["time"] > GRACE_S, events
    assert f"requeueing job {job_id} after SIGTERM" in log_text
    assert job_restarts(job_id) == 2

    rows = jsonl(metrics)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # exactly once each
    assert [r["version"] for r in rows] == list(range(1, STEPS + 1))
    assert events[-1]["event"] == "finished" and events[-1]["step"] == STEPS and events[-1]["restart"] == 2
    folders = RunCheckpoints(run_dir).folders()
    assert len(folders) == len(checkpoints)
    for folder in folders:  # every checkpoint is intact
        verify(folder)

    after_sizes = trajectory_sizes(run_dir)
    missing = sorted(set(held) - set(after_sizes))
    assert not missing, f"{len(missing)} trajectories of the killed allocation are gone: {missing[:5]}"
    shrunk = {tid: (held[tid], after_sizes[tid]) for tid in held if after_sizes[tid][1] < held[tid][1]}
    assert not shrunk, shrunk
    with open_store(run_dir / "trajectories.h5") as store:
        consumed = [m.trajectory_id for m in store.marks()]
        trajectories = list(store.trajectories())
    assert len(consumed) == len(set(consumed)), "a trajectory was trained on twice"
    # Every step consumed one whole batch; a step trained after the checkpoint of the killed allocation (its
    # weights lost) keeps its marks, so its trajectories are never trained again either.
    batch = GROUPS * GROUP_SIZE
    assert len(consumed) % batch == 0 and len(consumed) >= (STEPS + len(discarded)) * batch, len(consumed)

    # Trajectories continued across the preemption: tokens generated by the preempted allocation (it generates
    # between the stop request and its safe point, so the request's own time is not the cut) and tokens
    # generated by the last one. Each was then trained, waits for a batch, or was dropped as too stale; none
    # was given up.
    ended = stops[0]["time"]
    back = resumes[1]["time"] - resumes[1]["seconds"]
    across = [t for t in trajectories if any(s.generated and s.t_end < ended for s in t.segments)
              and any(s.generated and s.t_end > back for s in t.segments)]
    assert across, "no trajectory went on across the preemption"
    assert len(across) <= resumes[1]["resumed"], (len(across), resumes[1])
    assert all(t.status in ("consumed", "finished", "stale") for t in across), [(t.id, t.status) for t in across]
    for t in trajectories:  # nothing is left open but the look-ahead of the last allocation
        if t.created < back:
            assert t.status in ("consumed", "finished", "stale", "aborted"), (t.id, t.status)

    status = run_sfhpc("status", job_id, "--output-dir", str(tmp_path / "runs"))
    assert status.returncode == 0 and re.search(r"restarts?\D+2", status.stdout), status.stdout
