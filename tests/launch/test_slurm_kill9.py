"""A rank killed outright (``kill -9``: no signal handler, no checkpoint) on the dev cluster: the job
requeues itself and the run resumes from its last complete checkpoint, losing no recorded trajectory.

srun's ``--kill-on-bad-exit`` ends the step when one task dies; the batch script's step guard sees a
failed step with no signal from outside and requeues the job (``--requeue-on-failure``); the next run
(``SLURM_RESTART_COUNT=1``) finds the newest sound checkpoint, moves the metrics of steps trained after
it to ``metrics-discarded.jsonl`` and finishes the steps. The store survives the kill (flushed per batch,
SWMR): every trajectory it held right after the step died is still there, with at least those tokens.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from sfhpc.data.store import open_store
from sfhpc.launch.jobs import job_restarts, job_status
from sfhpc.rl.checkpoints import RunCheckpoints
from tests.conftest import run_sfhpc
from tests.launch.run_watch import jsonl, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]

STEPS = 10
KILL_AFTER = 3  # steps done; the last checkpoint is then step 2 (checkpoint_every: 2), so work is redone
RECIPE = f"""\
name: kill9
model: {{warm_start_steps: 5}}
algorithm: {{group_size: 4}}
pipeline: {{mode: async, max_staleness: 1}}
budgets: {{steps: {STEPS}, prompts_per_step: 4}}
task: {{name: next-letter}}
training: {{checkpoint_every: 2}}
roles:
  controller: {{place_with: trainer}}
  trainer:    {{tags: [train], nodes: 1}}
  rollout:    {{tags: [rollout], nodes: 1}}
launch: {{time_minutes: 15, signal_grace_s: 60}}
"""
ROLLOUT_RANK = 2  # controller 0 and trainer 1 on the train node, rollout 2 on the rollout node


def rank_processes(run_dir: Path) -> dict[int, int]:
    """SLURM_PROCID -> pid of the rank processes of a ``sfhpc launch`` run (``python -u -m
    submitit.core._submit RUN_DIR/submitit``), not the children they start (vLLM's engine core inherits
    both the command line, when forked, and the environment)."""
    folder = str(run_dir / "submitit").encode()
    found: dict[int, tuple[int, int]] = {}  # pid -> (procid, parent pid)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = dict(item.split(b"=", 1) for item in (entry / "environ").read_bytes().split(b"\0")
                           if b"=" in item)
            parent = int(re.search(rb"^PPid:\s+(\d+)", (entry / "status").read_bytes(), re.M).group(1))
        except (OSError, AttributeError):
            continue  # ended meanwhile
        if b"submitit.core._submit" in argv and folder in argv and b"SLURM_PROCID" in environ:
            found[int(entry.name)] = (int(environ[b"SLURM_PROCID"]), parent)
    return {procid: pid for pid, (procid, parent) in found.items() if parent not in found}


def test_a_rank_killed_with_sigkill_requeues_the_job_and_the_run_resumes(slurm_cluster: str, tmp_path: Path) -> None:
    recipe = tmp_path / "kill9.yaml"
    recipe.write_text(RECIPE + f"output_dir: {tmp_path / 'runs'}\n")
    done = run_sfhpc("launch", str(recipe))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    job_id = re.search(r"submitted job (\d+)", done.stdout).group(1)  # type: ignore[union-attr]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    try:
        _kill_and_follow(job_id, run_dir)
    finally:
        run_sfhpc("cancel", job_id)  # nothing is left running, whatever failed (a no-op once it completed)


def _kill_and_follow(job_id: str, run_dir: Path) -> None:
    metrics = run_dir / "metrics.jsonl"
    wait_until(f"{KILL_AFTER} steps", lambda: len(jsonl(metrics)) >= KILL_AFTER, timeout=600)
    ranks = rank_processes(run_dir)
    assert sorted(ranks) == [0, 1, ROLLOUT_RANK], ranks
    os.kill(ranks[ROLLOUT_RANK], signal.SIGKILL)

    # The step is over once no rank of this run is left (srun's --kill-on-bad-exit ended the others).
    wait_until("the step to end", lambda: not rank_processes(run_dir), timeout=120, poll_s=0.1)
    steps_at_kill = [r["step"] for r in jsonl(metrics)]
    latest = RunCheckpoints(run_dir).latest()
    # The newest periodic checkpoint (one being written at the kill, a hidden .partial folder, is not one).
    assert latest is not None and latest.step % 2 == 0 and 2 <= latest.step <= steps_at_kill[-1], steps_at_kill
    with open_store(run_dir / "trajectories.h5") as store:  # SWMR: the writer was killed with it open
        held = {t.id: (t.num_tokens, sum(len(s) for s in t.segments)) for t in store.trajectories()}
    assert held, "the store held nothing after the kill"
    assert not any(e["event"] == "stop-requested" for e in jsonl(run_dir / "events.jsonl") if e["restart"] == 0)

    def completed() -> str | None:
        try:
            status = job_status(job_id)
        except Exception:  # accounting lags a moment behind
            return None
        return status.state if status.state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") else None

    log = run_dir / f"slurm-{job_id}.out"
    state = wait_until("the job to end", completed, timeout=900, poll_s=2)
    assert state == "COMPLETED", log.read_text()[-6000:] if log.exists() else state
    assert job_restarts(job_id) == 1
    assert "requeueing job" in log.read_text()  # the step guard's one line

    rows = jsonl(metrics)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # exactly once each
    discarded = [r["step"] for r in jsonl(run_dir / "metrics-discarded.jsonl")]
    assert discarded == [s for s in steps_at_kill if s > latest.step]  # trained by weights the kill lost
    events = jsonl(run_dir / "events.jsonl")
    resumed = [e for e in events if e["event"] == "resumed"]
    assert len(resumed) == 1 and resumed[0]["restart"] == 1 and resumed[0]["step"] == latest.step, events
    assert events[-1]["event"] == "finished" and events[-1]["restart"] == 1

    with open_store(run_dir / "trajectories.h5") as store:
        after = {t.id: (t.num_tokens, sum(len(s) for s in t.segments)) for t in store.trajectories()}
        consumed = [m.trajectory_id for m in store.marks()]
    missing = sorted(set(held) - set(after))
    assert not missing, f"{len(missing)} trajectories of the killed run are gone: {missing[:5]}"
    shrunk = {tid: (held[tid], after[tid]) for tid in held if after[tid][1] < held[tid][1]}
    assert not shrunk, shrunk
    assert len(consumed) == len(set(consumed)), "a trajectory was trained on twice"
