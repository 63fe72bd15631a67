"""A run whose controller is killed (SIGKILL) after a periodic checkpoint, resumed with ``sfhpc run --resume``
(mpiexec, real torch, real HDF5; the deterministic test engine).

``async`` with ``max_staleness: 3`` keeps four steps of groups out; a group handed out at step s is played
while step s trains (by the weights of version s - 1) and trained at step s + 3. The checkpoint is at step 3
(version 3); the kill comes while step 6 trains, after its batch was taken (and the store flushed). So the
store holds groups the checkpoint never knew: those handed out at step 4, finished by version 3 (fresh for
the restored policy: trained as their own groups), and those of step 5, written by version 4, whose weights
died with the crash (dropped, never trained). The restored controller's group counter would spell the keys
of the lost allocation again; its new groups must not meet them.

A crash can also cut the last line of ``metrics.jsonl`` and ``events.jsonl`` (a kill, a full disk while it was
written): they are cut here before the resume. The analysis reads the folder as it is, warning of the cut line;
the resume sets the cut text aside beside each log (``<name>.damaged``) and appends after it.

The weights travel over the torch transport (a gloo group of the trainer and the rollout rank), built anew by
the resumed run.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sfhpc.bench._processes import rank_pids
from sfhpc.data.store import open_store
from sfhpc.rl.checkpoints import RunCheckpoints
from sfhpc.rl.resume import ControllerState
from sfhpc.tasks.letters import NextLetterTask
from tests.conftest import ROOT, run_sfhpc
from tests.rl.test_cut_logs import cut_last_line

pytestmark = [pytest.mark.mpi]

GROUP, PROMPTS, STALENESS = 2, 2, 3
RECIPE = f"""\
name: crash
seed: 4
engine: {{name: test, weight_transport: torch}}
model: {{build: {{layers: 1, hidden_size: 64, heads: 1}}}}
algorithm: {{group_size: {GROUP}}}
pipeline: {{mode: async, max_staleness: {STALENESS}}}
budgets: {{steps: 6, prompts_per_step: {PROMPTS}}}
training: {{checkpoint_every: 3}}
task: {{name: next-letter}}
roles:
  controller: {{place_with: trainer}}
  trainer:    {{tags: [train], nodes: 1}}
  rollout:    {{tags: [rollout], nodes: 1}}
"""
HOLD = {"SFHPC_HOLD_PHASES": "train=1"}  # each step trains for a second: time for a kill inside step 6


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


def world_rank(pid: int) -> int | None:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    found = [v for v in environ if v.startswith(b"OMPI_COMM_WORLD_RANK=")]
    return int(found[0].split(b"=")[1]) if found else None


def crash_in_step_6(recipe: Path, runs: Path) -> Path:
    """Start the run; SIGKILL the controller rank once step 6's batch is taken, while it trains."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", **HOLD)
    process = subprocess.Popen([sys.executable, "-m", "sfhpc", "run", str(recipe)], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline, run_dir = time.monotonic() + 120, None
    while time.monotonic() < deadline and process.poll() is None:
        folders = list(runs.glob("crash-*")) if runs.exists() else []
        if folders and len(rows(run_dir := folders[0])) >= 5:
            break
        time.sleep(0.02)
    assert run_dir is not None and process.poll() is None, "the run ended before it could be killed"
    with open_store(run_dir / "trajectories.h5") as store:  # step 6's batch taken: its marks are flushed
        while not any(mark.step == 6 for mark in store.marks()) and time.monotonic() < deadline:
            time.sleep(0.02)
            store.refresh()
    (controller,) = [pid for pid in rank_pids(run_dir) if world_rank(pid) == 0]
    os.kill(controller, signal.SIGKILL)
    out, _ = process.communicate(timeout=60)
    assert process.returncode != 0, out[-3000:]
    assert len(rows(run_dir)) == 5, out[-3000:]  # killed inside step 6, after the checkpoint of step 3
    assert [(e["event"], e["step"], e["reason"]) for e in events(run_dir)] == [("checkpoint", 3, "periodic")]
    return run_dir


def test_a_crashed_run_resumes_without_merging_groups_or_training_anything_twice(tmp_path: Path) -> None:
    recipe = tmp_path / "crash.yaml"
    recipe.write_text(RECIPE + f"output_dir: {tmp_path / 'runs'}\n")
    run_dir = crash_in_step_6(recipe, tmp_path / "runs")
    crashed_at = time.time()
    checkpoint = RunCheckpoints(run_dir).latest()
    assert checkpoint is not None and checkpoint.step == 3
    known = set(ControllerState.load(checkpoint.controller_file, NextLetterTask()).open_groups)  # out at the checkpoint
    with open_store(run_dir / "trajectories.h5") as store:
        before = list(store.trajectories())
    keys_before = {t.group for t in before}
    assert any(t.group not in known and t.status == "finished" for t in before), \
        "no group handed out after the checkpoint finished in the store"

    metrics_line, metrics_kept = cut_last_line(run_dir / "metrics.jsonl")  # step 5's row
    events_line, events_kept = cut_last_line(run_dir / "events.jsonl")  # the checkpoint's event
    report = run_sfhpc("traj", "report", str(run_dir))
    assert report.returncode == 0, report.stderr
    assert f"sfhpc: warning: {run_dir / 'metrics.jsonl'}: line {metrics_line} is cut" in report.stderr
    assert (run_dir / "report.html").stat().st_size > 1000
    assert not list(run_dir.glob("*.damaged"))  # a reader leaves the run folder as it is

    done = run_sfhpc("run", str(recipe), "--resume", str(run_dir), env=HOLD, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout + done.stderr
    assert f"{run_dir / 'metrics.jsonl'}: line {metrics_line} was cut" in out
    assert f"{run_dir / 'events.jsonl'}: line {events_line} was cut" in out
    assert (run_dir / "metrics.jsonl.damaged").read_bytes() == metrics_kept + b"\n"
    assert (run_dir / "events.jsonl.damaged").read_bytes() == events_kept + b"\n"
    # Both allocations sent the weights over a torch group (gloo) of the trainer and the rollout rank.
    logs = "".join(log.read_text() for log in (run_dir / "logs").glob("rank-*.log"))
    assert logs.count("weights travel over torch.distributed (gloo), 2 members; this rank sends as member 0") == 2
    assert logs.count("this rank receives as member 1") == 2
    (resumed,) = [e for e in events(run_dir) if e["event"] == "resumed"]
    assert resumed["step"] == 3 and resumed["version"] == 3
    assert resumed["waiting_groups"] >= 1  # step 4's groups, finished by version 3: trained as they are
    assert resumed["dropped_newer"] >= 1 and resumed["newer_tokens"] >= resumed["dropped_newer"]  # step 5's
    steps = rows(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    # After every step, before the crash and after it, the manager's book holds what the pipeline keeps out:
    # four steps of groups handed out, one step's taken.
    assert [r["groups_in_flight"] for r in steps] == [STALENESS * PROMPTS] * 6

    with open_store(run_dir / "trajectories.h5") as store:
        trajectories = {t.id: t for t in store.trajectories()}
        marks = store.marks()
    consumed = [m.trajectory_id for m in marks]
    assert len(consumed) == len(set(consumed)), "a trajectory was trained twice"
    resumed_at = resumed["time"] - resumed["seconds"]
    # The groups handed out after the restart: keys the store never held before the crash.
    handed_out_anew = {t.group for t in trajectories.values() if t.created > crashed_at} - known
    assert handed_out_anew and not handed_out_anew & keys_before, sorted(handed_out_anew & keys_before)
    # Every group trained after the restart: whole, of one hand-out, by tokens no newer than the policy, and
    # none written before the crash by weights the crash lost (newer than the checkpoint's).
    trained: dict[tuple[int, str], list[str]] = collections.defaultdict(list)
    for mark in marks:
        if mark.time > resumed_at:
            trajectory = trajectories[mark.trajectory_id]
            trained[(mark.step, trajectory.group)].append(mark.trajectory_id)
            assert trajectory.token_versions().max() <= mark.policy_version, mark
            lost = [int(v) for s in trajectory.segments if s.generated and s.t_end < crashed_at for v in s.versions]
            assert max(lost, default=0) <= checkpoint.version, (mark, lost)
    assert sorted(step for step, _ in trained) == [4] * PROMPTS + [5] * PROMPTS + [6] * PROMPTS
    kept_whole = 0
    for (step, group), members in trained.items():
        assert len(members) == GROUP, (step, group, members)
        if group not in known:  # handed out by one allocation: all its members come from it
            by_lost = [trajectories[m].created < crashed_at for m in members]
            assert all(by_lost) or not any(by_lost), (group, members)
            kept_whole += all(by_lost)
    assert kept_whole >= 1  # a group of the lost allocation trained as its own group
    assert collections.Counter(group for _, group in trained).most_common(1)[0][1] == 1  # each group once
