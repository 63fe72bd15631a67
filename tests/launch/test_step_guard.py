"""The step guard: transparent while srun behaves, ends it once it outlives every rank, requeues a
failed job while it has restarts left.

srun here is `tests.launch.hung_srun`, a stand-in (the Slurm 22.05 mpi/pmix hang cannot be produced on
demand); its ranks leave their marks through the same `arm`/`finished` calls real ranks use. Every Slurm
launch test runs its srun under the real guard too. The failure-requeue tests put a stand-in `scontrol`
on PATH that only writes down how it was called (tests/launch/test_slurm_requeue.py requeues real jobs).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sfhpc.launch.step_guard import guard
from tests.conftest import ROOT

STAND_IN = [sys.executable, "-m", "tests.launch.hung_srun"]


def test_a_hung_srun_is_ended_after_the_grace_and_the_ranks_outcome_returned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    start = time.monotonic()
    status = guard([*STAND_IN, "3"], ranks=3, grace_s=1.0, marks=tmp_path / "marks", poll_s=0.1)
    assert status == 0
    assert time.monotonic() - start < 60  # the stand-in lingers forever on its own
    assert not (tmp_path / "marks").exists()  # the guard cleans its marks up
    failing = guard([*STAND_IN, "3", "--outcomes", "0,2,0"], ranks=3, grace_s=0.5, marks=tmp_path / "m2",
                    poll_s=0.1)
    assert failing == 2  # the worst outcome a rank reported


def test_after_a_term_a_hung_srun_is_ended_within_slurms_kill_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A requeue's TERM reaches the guard (the batch shell), which holds it; Slurm kills the shell KillWait
    # later, so a srun that hangs after its ranks left gets a few seconds, not the 30 s grace.
    import threading

    from sfhpc.launch.step_guard import STOPPING_GRACE_S

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    start = time.monotonic()
    assert guard([*STAND_IN, "3"], ranks=3, grace_s=30, marks=tmp_path / "marks", poll_s=0.1) == 0
    assert STOPPING_GRACE_S <= time.monotonic() - start < 20


def test_srun_that_ends_by_itself_keeps_its_status_and_missing_marks_keep_the_guard_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    assert guard([*STAND_IN, "2", "--linger", "0", "--exit", "3"], ranks=2, grace_s=0.2,
                 marks=tmp_path / "a", poll_s=0.05) == 3
    # One rank of three left no mark (it crashed): the guard must not end srun, however long it takes.
    start = time.monotonic()
    assert guard([*STAND_IN, "3", "--marks", "2", "--linger", "2", "--exit", "0"], ranks=3, grace_s=0.2,
                 marks=tmp_path / "b", poll_s=0.05) == 0
    assert time.monotonic() - start >= 2


def test_signals_reach_srun_through_the_guard(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    process = subprocess.Popen([sys.executable, "-m", "sfhpc.launch.step_guard", "--ranks", "9", "--",
                                *STAND_IN, "1"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "ranks done"
    process.send_signal(signal.SIGUSR1)  # as scancel --signal=USR1 --batch would
    assert process.wait(timeout=30) == 10
    assert not (tmp_path / ".sfhpc-steps").exists()


@pytest.fixture
def fake_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in `scontrol` first on PATH: it appends its arguments to the returned file, exits 0."""
    calls = tmp_path / "scontrol-calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    return calls


def calls_of(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_a_failed_step_requeues_its_job_while_restarts_are_left(
        fake_scontrol: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    failing = [*STAND_IN, "1", "--linger", "0", "--exit", "3"]
    assert guard(failing, ranks=1, marks=tmp_path / "a", poll_s=0.05, requeue_on_failure=3) == 3
    assert calls_of(fake_scontrol) == ["requeue 77"]
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("sfhpc:")]
    assert lines == ["sfhpc: the step failed (exit 3); requeueing job 77 (restart 1 of 3): it resumes from its last "
                     "checkpoint"]
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert guard(failing, ranks=1, marks=tmp_path / "b", poll_s=0.05, requeue_on_failure=3) == 3
    assert calls_of(fake_scontrol) == ["requeue 77", "requeue 77"]
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")  # the last restart failed too: the job ends FAILED
    assert guard(failing, ranks=1, marks=tmp_path / "c", poll_s=0.05, requeue_on_failure=3) == 3
    assert len(calls_of(fake_scontrol)) == 2
    refused = "job 77 is not requeued: it has been restarted 3 time(s), launch.max_restarts is 3"
    assert refused in capsys.readouterr().err


def test_the_hang_handling_outcome_counts_as_a_failure_too(fake_scontrol: Path, tmp_path: Path) -> None:
    hung = [*STAND_IN, "2", "--outcomes", "0,1"]  # srun hangs after rank 1 failed
    assert guard(hung, ranks=2, grace_s=0.3, marks=tmp_path / "m", poll_s=0.05, requeue_on_failure=1) == 1
    assert calls_of(fake_scontrol) == ["requeue 77"]


@pytest.mark.parametrize(("exit_code", "limit"), [(0, 3), (2, 3), (3, 0), (3, None)],
                         ids=["success", "user-error", "max-restarts-0", "option-off"])
def test_no_requeue_on_success_user_error_or_when_off(fake_scontrol: Path, tmp_path: Path, exit_code: int,
                                                       limit: int | None) -> None:
    command = [*STAND_IN, "1", "--linger", "0", "--exit", str(exit_code)]
    assert guard(command, ranks=1, marks=tmp_path / "m", poll_s=0.05, requeue_on_failure=limit) == exit_code
    assert calls_of(fake_scontrol) == []


def test_a_rank_that_reported_a_user_error_keeps_the_job_from_requeueing(fake_scontrol: Path, tmp_path: Path) -> None:
    # srun exits 1 (the other ranks were killed), but rank 1's mark says 2: a rerun would fail alike.
    command = [*STAND_IN, "2", "--outcomes", "0,2", "--linger", "0.3", "--exit", "1"]
    assert guard(command, ranks=2, grace_s=30, marks=tmp_path / "m", poll_s=0.05, requeue_on_failure=3) == 1
    assert calls_of(fake_scontrol) == []


def test_no_requeue_outside_a_job(fake_scontrol: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID")
    assert guard([*STAND_IN, "1", "--linger", "0", "--exit", "3"], ranks=1, marks=tmp_path / "m", poll_s=0.05,
                 requeue_on_failure=3) == 3
    assert calls_of(fake_scontrol) == []


def test_a_step_stopped_from_outside_is_not_requeued_by_the_guard(fake_scontrol: Path, tmp_path: Path) -> None:
    # The guard is the batch shell (exec): TERM (cancel, requeue, preemption, time limit) is held, not passed
    # on (srun would kill the step at once; Slurm sends the ranks their TERM itself), and the guard keeps
    # waiting; Slurm or the ranks decide about a requeue then, not the guard.
    process = subprocess.Popen([sys.executable, "-m", "sfhpc.launch.step_guard", "--ranks", "9",
                                "--requeue-on-failure", "3", "--", *STAND_IN, "1"], cwd=tmp_path,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "ranks done"
    process.send_signal(signal.SIGTERM)
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=2)  # neither the guard nor its srun ended
    process.send_signal(signal.SIGUSR1)
    assert process.wait(timeout=30) == 10
    process = subprocess.Popen([sys.executable, "-m", "sfhpc.launch.step_guard", "--ranks", "9",
                                "--requeue-on-failure", "3", "--", *STAND_IN, "1"], cwd=tmp_path,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "ranks done"
    process.send_signal(signal.SIGUSR1)  # a checkpoint request: the ranks requeue the job themselves
    assert process.wait(timeout=30) == 10
    assert calls_of(fake_scontrol) == []


def test_bad_requeue_option_is_a_usage_error(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "sfhpc.launch.step_guard", "--ranks", "1", "--requeue-on-failure",
                           "-1", "--", "true"], cwd=tmp_path, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 2 and "--requeue-on-failure must be 0 (never) or more" in done.stderr
