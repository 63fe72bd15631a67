"""Rollout workers of another process group joining a running run and leaving it (`sfhpc.rl.attached`), on one
machine: the run under mpiexec (real MPI, torch, HDF5; the paced test engine), each worker a process of its own
(`python -m sfhpc.rank.attached`), outside the run's MPI world, as a worker of another Slurm job is.

A first worker joins, plays, and is told to go (SIGTERM, what a preemption or ``scancel`` sends): its cut episodes
continue on the run's rollout rank from their prefix. A second joins and is killed without a word (SIGKILL): what
it had open is aborted and its episodes are played again. The run finishes every step; every trajectory the
workers generated is in the store; nothing is trained twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sfhpc.data.store import open_store
from tests.conftest import ROOT

pytestmark = [pytest.mark.mpi]

STEPS = 24
RECIPE = f"""\
name: attach
seed: 3
engine: {{name: test, token_delay_s: 0.05, writes_to_budget: true}}
model: {{build: {{layers: 1, hidden_size: 64, heads: 1, chat_format: brief_tools}}}}
algorithm: {{group_size: 4}}
pipeline: {{mode: async, max_staleness: 1}}
budgets: {{steps: {STEPS}, prompts_per_step: 2, max_new_tokens: 24}}
task: {{name: arith-tool}}
roles:
  controller: {{place_with: trainer}}
  trainer:    {{tags: [train], nodes: 1}}
  rollout:    {{tags: [rollout], nodes: 1}}
"""


def env() -> dict[str, str]:
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")


def wait_for(condition, what: str, run: subprocess.Popen[str], timeout: float = 300) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        if run.poll() is not None:
            pytest.fail(f"the run ended while waiting for {what}:\n{run.communicate()[0][-3000:]}")
        if time.monotonic() > deadline:
            run.kill()
            pytest.fail(f"no {what} within {timeout} s:\n{run.communicate()[0][-3000:]}")
        time.sleep(0.1)


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def worker(run_dir: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "sfhpc.rank.attached", str(run_dir)], cwd=ROOT, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_workers_join_a_running_run_and_leave_with_or_without_a_word(tmp_path: Path) -> None:
    recipe = tmp_path / "attach.yaml"
    recipe.write_text(RECIPE + f"output_dir: {tmp_path / 'runs'}\n")
    run = subprocess.Popen([sys.executable, "-m", "sfhpc", "run", str(recipe)], cwd=ROOT, env=env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    runs = tmp_path / "runs"
    wait_for(lambda: runs.exists() and any(runs.glob("attach-*/attach/weights.json")), "weight server", run)
    run_dir = next(runs.glob("attach-*"))

    def joined(count: int) -> bool:
        return sum(e["event"] == "worker-attached" for e in events(run_dir)) >= count

    first = worker(run_dir)
    wait_for(lambda: joined(1), "first worker", run)
    at = steps_done(run_dir)
    wait_for(lambda: steps_done(run_dir) >= at + 4, "four steps with the first worker", run)
    time.sleep(0.6)  # half a reply at the engine's pace: the episodes handed out as the step ended are mid-reply
    first.send_signal(signal.SIGTERM)
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 0, out[-3000:]
    assert "left the run on SIGTERM" in out

    second = worker(run_dir)
    wait_for(lambda: joined(2), "second worker", run)
    at = steps_done(run_dir)
    wait_for(lambda: steps_done(run_dir) >= at + 4, "four steps with the second worker", run)
    time.sleep(0.6)
    second.kill()
    second.communicate(timeout=60)

    out, _ = run.communicate(timeout=600)
    assert run.returncode == 0, out[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    seen = events(run_dir)
    attached = [e for e in seen if e["event"] == "worker-attached"]
    left = [e for e in seen if e["event"] == "worker-left"]
    assert [e["rank"] for e in attached] == [3, 4]  # beyond the world's three ranks
    assert [(e["rank"], e["said"]) for e in left] == [(3, True), (4, False)]
    assert "joined the run" in out and "the rollout worker left" in out

    with open_store(run_dir / "trajectories.h5") as store:
        trajectories = list(store.trajectories())
        consumed_by = [m.trajectory_id for m in store.marks()]
    assert len(consumed_by) == len(set(consumed_by)) == STEPS * 2 * 4  # nothing trained twice
    by_engine = {}
    for t in trajectories:
        for s in t.segments:
            if s.generated:
                by_engine.setdefault(s.engine, set()).add(t.id)
    assert by_engine.get("test-r3") and by_engine.get("test-r4"), sorted(by_engine)  # both workers generated
    # Cut on the first worker, continued on the run's rollout rank: one reply, two engines, one trajectory.
    moved = [t for t in trajectories if t.id in by_engine["test-r3"] and t.id in by_engine["test-r2"]]
    assert 1 <= len(moved) <= left[0]["continued"]  # (one cut before its first token has no token of the worker's)
    assert left[0]["interrupted"] >= left[0]["continued"]
    # What the killed worker had open was given up (aborted, never trained) and played again elsewhere.
    lost = [t for t in trajectories if t.status == "aborted"]  # (nothing else in this run aborts a trajectory)
    assert left[1]["aborted"] == len(lost) >= 1 and left[1]["started_again"] >= len(lost)
    assert left[1]["lost_tokens"] == sum(len(s.tokens) for t in lost for s in t.segments if s.generated)
    assert left[0]["aborted"] == left[0]["lost_tokens"] == 0  # told to go: nothing it generated is lost
