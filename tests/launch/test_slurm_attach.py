"""`sfhpc attach` on the dev cluster: a job of its own whose rollout worker joins a running run outside its MPI
world, is preempted (``scontrol requeue``: TERM, then Slurm starts the job again and the worker joins again) and
later cancelled (``scancel``) while the run's steps go on. The run's rollout rank and the worker are the timing
engine (the test engine paced, each decode step slower for every sequence in flight, as a GPU's is), so a second
engine raises the run's steps per minute, measured here. Every trajectory is accounted for: the run finishes
each step once, nothing is trained twice, and what the worker had generating when its job told it to go
continues on the run's own rollout rank from its prefix."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from sfhpc.data.store import open_store
from tests.conftest import RECIPES, run_sfhpc
from tests.launch.run_watch import job_end_state, jsonl, read_events, wait_until

pytestmark = pytest.mark.slurm

STEPS = 70
RECIPE = f"""\
name: attach-slurm
seed: 4
engine: {{name: test, token_delay_s: 0.01, writes_to_budget: true}}
timing_model: {{per_sequence_s: 0.004, train_step_s: 0.05}}
training: {{backend: timing}}
model: {{build: {{layers: 1, hidden_size: 64, heads: 1}}}}
algorithm: {{group_size: 4}}
pipeline: {{mode: async, max_staleness: 1}}
budgets: {{steps: {STEPS}, prompts_per_step: 4, max_new_tokens: 8}}
task: {{name: repeat-letter}}
roles:
  controller: {{place_with: trainer}}
  trainer:    {{tags: [train], nodes: 1}}
  rollout:    {{tags: [rollout], nodes: 1}}
launch: {{time_minutes: 15}}
"""
CLUSTER = str(RECIPES / "cluster-dev.yaml")


def steps_per_minute(rows: list[dict], first: int, last: int) -> float:
    """Steps `first`..`last` (metrics rows' steps) per minute of wall time."""
    times = {r["step"]: r["elapsed_s"] for r in rows}
    return 60 * (last - first) / (times[last] - times[first])


def attached(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == "worker-attached"]


def left(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == "worker-left"]


def test_an_attached_worker_joins_is_preempted_joins_again_and_leaves(slurm_cluster: str, tmp_path: Path) -> None:
    recipe = tmp_path / "attach.yaml"
    recipe.write_text(RECIPE + f"output_dir: {tmp_path / 'runs'}\n")
    done = run_sfhpc("launch", str(recipe), "--cluster", CLUSTER)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    main = re.search(r"submitted job (\d+)", done.stdout).group(1)  # type: ignore[union-attr]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    job = None
    try:
        wait_until("the run's weight server", lambda: (run_dir / "attach" / "weights.json").exists(), timeout=300)
        metrics = run_dir / "metrics.jsonl"
        wait_until("step 3", lambda: len(jsonl(metrics)) >= 3, timeout=300)
        done = run_sfhpc("attach", str(run_dir), "--rollout", "1", "--partition", "rollout", "--cluster", CLUSTER)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        job = re.search(r"submitted attach job (\d+)", done.stdout).group(1)  # type: ignore[union-attr]
        wait_until("the worker", lambda: attached(run_dir), timeout=300)
        joined_at = attached(run_dir)[0]["step"]
        wait_until("8 steps with the worker", lambda: len(jsonl(metrics)) >= joined_at + 8, timeout=300)
        subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True, timeout=30)
        wait_until("the preempted worker's leaving", lambda: left(run_dir), timeout=120)
        wait_until("the worker's return", lambda: len(attached(run_dir)) >= 2, timeout=300)
        back_at = attached(run_dir)[1]["step"]
        wait_until("3 steps with the worker back", lambda: len(jsonl(metrics)) >= back_at + 3, timeout=300)
        subprocess.run(["scancel", job], check=True, capture_output=True, timeout=30)
        wait_until("the cancelled worker's leaving", lambda: len(left(run_dir)) >= 2, timeout=120)
        cancelled_at = left(run_dir)[1]["step"]
        wait_until("the run's end", lambda: job_end_state(main), timeout=600)
    finally:
        for some in (main, job):
            if some is not None:
                subprocess.run(["scancel", some], capture_output=True, timeout=30)
    assert job_end_state(main) == "COMPLETED", run_sfhpc("logs", main, "--output-dir", str(tmp_path / "runs")).stdout

    rows = jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    joins, leaves = attached(run_dir), left(run_dir)
    assert len(joins) == 2 and [e["said"] for e in leaves] == [True, True], (joins, leaves)
    assert [e["worker_job"] for e in joins] == [job, job] and joins[0]["rank"] != joins[1]["rank"]
    assert all("SIGTERM" in e["reason"] for e in leaves)
    preempted_at = leaves[0]["step"]
    # Steps per minute: before the worker came, and while it was there the first time (a step or two after each
    # change, so that no step straddles it).
    alone = steps_per_minute(rows, 2, joined_at)
    together = steps_per_minute(rows, joined_at + 2, preempted_at)
    print(f"steps per minute: {alone:.1f} with the run's rollout rank alone, {together:.1f} with the worker "
          f"({together / alone:.2f}x); worker left at steps {preempted_at} and {cancelled_at}")
    assert together > 1.2 * alone

    with open_store(run_dir / "trajectories.h5") as store:
        trajectories = {t.id: t for t in store.trajectories()}
        consumed_by = [m.trajectory_id for m in store.marks()]
    assert len(consumed_by) == len(set(consumed_by)) == STEPS * 4 * 4  # nothing trained twice, nothing missing
    worker_engines = {f"test-r{e['rank']}" for e in joins}
    engines = {t.id: [s.engine for s in t.segments if s.generated] for t in trajectories.values()}
    generated_by_worker = [tid for tid, names in engines.items() if worker_engines & set(names)]
    assert len(generated_by_worker) >= 16, "the worker generated little"
    trained_by_worker = set(generated_by_worker) & set(consumed_by)
    assert trained_by_worker, "nothing the worker generated was trained on"
    # Cut on the worker when its job told it to go, continued on the run's rollout rank from the prefix.
    continued = [tid for tid, names in engines.items() if worker_engines & set(names) and "test-r2" in names
                 and names.index("test-r2") > min(names.index(w) for w in worker_engines if w in names)]
    # (an episode cut before its first token continues too, with nothing of the worker's in it)
    assert 1 <= len(continued) <= sum(e["continued"] for e in leaves)
    # What it generated before a cut is in the store and trained with its continuation: nothing was given up.
    assert sum(e["aborted"] for e in leaves) == 0 and sum(e["lost_tokens"] for e in leaves) == 0
    for tid in continued:
        assert trajectories[tid].status in ("consumed", "stale", "finished"), tid
