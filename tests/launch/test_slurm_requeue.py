"""Runs that outlive their allocation, on the real dev cluster: signals reach every rank through the
batch script, the batch shell survives a requeue's TERM, and `sfhpc launch --wait` follows the job.

The job is a two-component het job rendered by the real renderer (`spec_for_plan`, the launch script's
shape: the step guard exec'd as the batch shell, srun over both components) whose ranks are
`tests.launch.signal_probe`: tiny programs that write down the signals they get.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sfhpc.config import load_cluster_map, load_recipe
from sfhpc.launch.jobs import job_restarts, job_status
from sfhpc.launch.sbatch import render_sbatch, spec_for_plan
from sfhpc.plan.resolve import resolve
from tests.conftest import RECIPES, ROOT

pytestmark = pytest.mark.slurm

RECIPE = """\
name: signals
roles:
  controller: {place_with: trainer}
  trainer:    {tags: [train], nodes: 1}
  rollout:    {tags: [rollout], nodes: 1}
launch: {time_minutes: 3, signal_grace_s: 60, max_restarts: 1}
"""
RANKS = 3  # controller + trainer on a train node, rollout on a rollout node


def submit(tmp_path: Path) -> tuple[str, Path]:
    """Render the probe job, sbatch it from `tmp_path`; (job id, folder the ranks write into)."""
    recipe_path = tmp_path / "signals.yaml"
    recipe_path.write_text(RECIPE)
    recipe, cluster = load_recipe(recipe_path), load_cluster_map(RECIPES / "cluster-dev.yaml")
    plan = resolve(recipe, cluster)
    assert plan.world_size == RANKS and len(plan.components) == 2
    probes = tmp_path / "probes"
    probes.mkdir()
    python = sys.executable
    spec = spec_for_plan(plan, recipe, f"{python} -m tests.launch.signal_probe {probes}",
                         output=str(tmp_path / "slurm-%j.out"), python=python)
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(spec))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(["sbatch", "--parsable", str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, check=True)
    return done.stdout.strip().split(";")[0], probes


def rank_logs(probes: Path) -> dict[int, list[str]]:
    return {int(p.stem.removeprefix("rank-")): p.read_text().splitlines() for p in probes.glob("rank-*.log")}


def wait_until(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.3)


def all_started(probes: Path, restart: int = 0) -> bool:
    logs = rank_logs(probes)
    return len(logs) == RANKS and all(f"restart={restart} start" in lines for lines in logs.values())


def sacct_states(job_id: str) -> dict[str, str]:
    try:
        return {c.job_id: c.state for c in job_status(job_id).components}
    except Exception:  # accounting lags a moment behind
        return {}


def first_run_records(job_id: str) -> dict[str, tuple[str, str, str]]:
    """JobID -> (state, exit code, end) of the first run's records (sacct --duplicates lists every run)."""
    out = subprocess.run(["sacct", "-j", job_id, "--duplicates", "--noheader", "--parsable2", "-o",
                          "JobID,State,ExitCode,End"], capture_output=True, text=True, check=True).stdout
    records: dict[str, tuple[str, str, str]] = {}
    for line in out.splitlines():
        name, state, code, end = line.split("|")
        records.setdefault(name, (state, code, end))
    return records


def completed(job_id: str) -> dict[str, str]:
    return {f"{job_id}+0": "COMPLETED", f"{job_id}+1": "COMPLETED"}


def test_usr1_to_the_batch_shell_reaches_every_rank(slurm_cluster: str, tmp_path: Path) -> None:
    job_id, probes = submit(tmp_path)
    try:
        wait_until(lambda: all_started(probes), 60, "every rank to start")
        # What --signal=B:USR1@N does ahead of the time limit: a signal to the batch shell only.
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)
        wait_until(lambda: sacct_states(job_id) == completed(job_id), 40, "the job to complete")
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    logs = rank_logs(probes)
    for rank in range(RANKS):
        assert "restart=0 SIGUSR1" in logs[rank] and logs[rank][-1] == "restart=0 exit after SIGUSR1", logs
        assert "restart=0 SIGTERM" not in logs[rank]
    exit_codes = {c.exit_code for c in job_status(job_id).components}
    assert exit_codes == {"0:0"}
    assert job_restarts(job_id) == 0


def test_a_requeue_keeps_the_batch_shell_and_the_run_comes_back(
        slurm_cluster: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sfhpc.cli import _wait

    job_id, probes = submit(tmp_path)
    try:
        wait_until(lambda: all_started(probes), 60, "every rank to start")
        # TERM to the batch shell and every step, SIGKILL after KillWait (10 s): the ranks finish their 2 s
        # "checkpoint" only if the batch shell (the step guard) stays until the step is over.
        subprocess.run(["scontrol", "requeue", job_id], check=True)
        assert _wait(job_id, tmp_path, timeout=90, poll_s=0.5) == 0  # `sfhpc launch --wait`, across the requeue
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    out = capsys.readouterr().out
    assert "requeued (restart 1)" in out and out.index("requeued (restart 1)") < out.rindex(f"job {job_id}: COMPLETED")
    logs = rank_logs(probes)
    for rank in range(RANKS):
        first, second = logs[rank].index("restart=0 start"), logs[rank].index("restart=1 start")
        assert "restart=0 SIGTERM" in logs[rank][first:second], logs
        assert "restart=0 exit after SIGTERM" in logs[rank][first:second], logs  # not killed before the end
        assert logs[rank][-1] == "restart=1 start", logs  # the second run saw SLURM_RESTART_COUNT=1
    assert "DUE TO JOB REQUEUE" in out  # the batch log of both runs (open-mode append), printed at the end
    wait_until(lambda: sacct_states(job_id) == completed(job_id), 30, "sacct to show the second run")
    assert job_restarts(job_id) == 1
    # The first run's batch shell outlived its step and ended with its status; a shell that died of the
    # requeue's TERM shows CANCELLED 0:15, ending before the step.
    records = first_run_records(job_id)
    batch, step = records[f"{job_id}+0.batch"], records[f"{job_id}+0.0"]
    assert records[f"{job_id}+0"][0] == "REQUEUED"
    assert batch[:2] == ("COMPLETED", "0:0") and batch[2] >= step[2], records
