"""A run cut by a stop signal and resumed on one machine (mpiexec, real vLLM, real torch, real HDF5).

The signal goes to every rank process, as Slurm delivers it to a step's tasks. The run checkpoints at the
next safe point and exits with 75; ``sfhpc run --resume`` continues it to its last step.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sfhpc.bench._processes import step_pids
from sfhpc.data.store import open_store
from tests.conftest import ROOT, assert_one_line_error, run_sfhpc

pytestmark = [pytest.mark.vllm, pytest.mark.mpi]

MULTI_TURN = """\
name: cut
seed: 5
model: {warm_start_steps: 10}
algorithm: {group_size: 4}
pipeline: {mode: async, max_staleness: 1}
budgets: {steps: 6, prompts_per_step: 4}
task: {name: guess-number, options: {max_turns: 6}}
roles:
  controller: {place_with: trainer}
  trainer:    {tags: [train], nodes: 1}
  rollout:    {tags: [rollout], nodes: 1}
"""


def start_run(recipe: Path, *extra: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    return subprocess.Popen([sys.executable, "-m", "sfhpc", "run", str(recipe), *extra], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def cut_after(recipe: Path, runs: Path, steps: int) -> tuple[Path, str]:
    """Start the recipe, SIGTERM every process of the ranks (vLLM's engine too, as Slurm does) once `steps`
    steps are done; returns the run folder and the output."""
    process = start_run(recipe)
    deadline = time.monotonic() + 600
    run_dir = None
    while time.monotonic() < deadline and process.poll() is None:
        folders = list(runs.glob("cut-*")) if runs.exists() else []
        if folders and steps_done(run_dir := folders[0]) >= steps:
            break
        time.sleep(0.2)
    assert run_dir is not None and process.poll() is None, "the run ended before it could be cut"
    for pid in step_pids(run_dir):
        with contextlib.suppress(ProcessLookupError):  # a helper process that ended meanwhile
            os.kill(pid, signal.SIGTERM)
    out, _ = process.communicate(timeout=300)
    assert process.returncode == 75, out[-4000:]  # stopped at a safe point: resumable, not done
    return run_dir, out


def test_a_cut_run_resumes_its_trajectories_and_trains_nothing_twice(tmp_path: Path) -> None:
    recipe = tmp_path / "cut.yaml"
    recipe.write_text(MULTI_TURN + f"output_dir: {tmp_path / 'runs'}\n")
    run_dir, out = cut_after(recipe, tmp_path / "runs", 2)
    assert "stop requested: SIGTERM" in out and f"--resume {run_dir}" in out
    before = events(run_dir)
    assert [e["event"] for e in before] == ["stop-requested", "checkpoint", "quiesced", "stopped"]
    cut_time, stopped_at = before[0]["time"], before[-1]["step"]
    assert stopped_at >= 2 and before[1]["reason"] == "stop:SIGTERM"
    with open_store(run_dir / "trajectories.h5") as store:
        open_at_cut = {t.id for t in store.trajectories() if t.status in ("interrupted", "running")}
    assert open_at_cut, "nothing was in flight at the cut"

    # A newer checkpoint whose weights were cut short (a write the kill interrupted, a damaged disk) is named
    # and skipped, never deleted; the run resumes from the sound one before it.
    damaged = run_dir / "checkpoints" / "step-000099"
    shutil.copytree(before[1]["path"], damaged)
    (damaged / "trainer.pt").write_bytes((damaged / "trainer.pt").read_bytes()[:1000])
    done = run_sfhpc("run", str(recipe), "--resume", str(run_dir), timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert f"checkpoint {damaged}: trainer.pt has 1000 bytes" in done.stderr + done.stdout
    assert damaged.exists()
    resumed = [e for e in events(run_dir) if e["event"] == "resumed"]
    assert len(resumed) == 1 and resumed[0]["step"] == stopped_at and resumed[0]["checkpoint"] == before[1]["path"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))  # continued, no step repeated
    assert [r["version"] for r in rows] == list(range(1, 7))
    with open_store(run_dir / "trajectories.h5") as store:
        marks = store.marks()
        trajectories = {t.id: t for t in store.trajectories()}
    consumed_by = [m.trajectory_id for m in marks]
    assert len(consumed_by) == len(set(consumed_by)) == 6 * 4 * 4  # nothing trained twice
    continued = [t for tid, t in trajectories.items() if tid in open_at_cut
                 and any(s.t_end < cut_time for s in t.segments[1:])
                 and any(s.generated and s.t_start > resumed[0]["time"] - resumed[0]["seconds"] for s in t.segments)]
    assert continued, "no trajectory went on across the restart"
    assert len(continued) <= resumed[0]["resumed"] + resumed[0]["replayed"]
    for trajectory_id in open_at_cut:  # every one of them finished (and maybe trained on), or was dropped
        assert trajectories[trajectory_id].status in ("consumed", "finished", "stale", "aborted"), trajectory_id
    stale = sum(1 for tid in open_at_cut if trajectories[tid].status == "stale")
    assert stale <= resumed[0]["dropped_stale"] + 4 * 4  # dropped at the restart, or later by the bound

    # Slurm may requeue a finished job: resuming a complete run changes nothing.
    listing = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert "step-000006" in listing
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    again = run_sfhpc("run", str(recipe), "--resume", str(run_dir), timeout=300)
    assert again.returncode == 0 and "is complete" in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == listing
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics


def test_resume_refuses_what_is_not_a_run_of_this_recipe(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(MULTI_TURN + f"output_dir: {tmp_path / 'runs'}\n")
    not_a_run = tmp_path / "photos"
    not_a_run.mkdir()
    done = run_sfhpc("run", str(recipe), "--resume", str(not_a_run))
    assert_one_line_error(done, "not a run folder")
    done = run_sfhpc("run", str(recipe), "--resume", str(tmp_path / "missing"))
    assert_one_line_error(done, "no such folder")
    assert not (tmp_path / "runs").exists()  # nothing written
    assert list(not_a_run.iterdir()) == []


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path: Path) -> None:
    from sfhpc.config import load_recipe
    from sfhpc.rl.checkpoints import RunCheckpoints, run_identity

    recipe = tmp_path / "r.yaml"
    recipe.write_text(MULTI_TURN + f"output_dir: {tmp_path / 'runs'}\n")
    run_dir = tmp_path / "runs" / "cut-earlier"
    (run_dir / "model").mkdir(parents=True)
    (run_dir / "model" / "config.json").write_text('{"hidden_size": 256}')
    checkpoints = RunCheckpoints(run_dir)
    partial = checkpoints.begin(3)
    (partial / "trainer.pt").write_bytes(b"x")
    checkpoints.commit(partial, step=3, version=3, identity=run_identity(load_recipe(recipe), run_dir / "model"),
                       reason="test")
    (run_dir / "model" / "config.json").write_text('{"hidden_size": 512}')  # another model now
    before = sorted(str(p) for p in run_dir.rglob("*"))
    done = run_sfhpc("run", str(recipe), "--resume", str(run_dir))
    line = assert_one_line_error(done, "another recipe or model", "model_config_sha256")
    assert re.search(r"step-000003", line)
    assert sorted(str(p) for p in run_dir.rglob("*")) == before
