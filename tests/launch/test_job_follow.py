"""Following a job across requeues (`sfhpc launch --wait`) and its restarts in `sfhpc status`, from what
scontrol and sacct print (their outputs below were copied from the dev cluster; no Slurm is asked here:
the CLI tests put stand-in `scontrol` and `sacct` scripts on PATH)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from sfhpc.launch.jobs import JobFollower, LiveJob, count_runs, parse_scontrol_job
from tests.conftest import assert_one_line_error, run_sfhpc

# `scontrol show job -o 9` of a two-component het job (trimmed to the fields that matter, order kept).
HET_RUNNING = (
    "JobId=9 HetJobId=9 HetJobOffset=0 JobName=het.sh Account=root QOS=normal JobState=RUNNING Reason=None "
    "Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 ExitCode=0:0 Partition=train NodeList=n1 "
    "Command=/tmp/rq/het job.sh WorkDir=/tmp/rq\n"
    "JobId=10 HetJobId=9 HetJobOffset=1 JobName=het.sh JobState=RUNNING Reason=None Requeue=1 Restarts=0 "
    "Partition=rollout NodeList=n3\n")
HET_REQUEUED = HET_RUNNING.replace("JobState=RUNNING Reason=None", "JobState=PENDING Reason=BeginTime").replace(
    "Restarts=0", "Restarts=1")
SACCT_DUPLICATES = "9+0\n9+1\n9+0\n9+1\n"  # sacct -j 9 --duplicates -X -o JobID: two runs


def live(state: str, restarts: int = 0, reason: str = "None") -> LiveJob:
    return LiveJob(state, reason, restarts)


def test_scontrol_lines_give_the_combined_state_reason_and_restarts() -> None:
    assert parse_scontrol_job(HET_RUNNING) == LiveJob("RUNNING", "None", 0)
    assert parse_scontrol_job(HET_REQUEUED) == LiveJob("PENDING", "BeginTime", 1)
    ending = HET_RUNNING.replace("JobState=RUNNING Reason=None Dependency", "JobState=COMPLETED Reason=None "
                                 "Dependency")  # component 0 done, component 1 still running
    assert parse_scontrol_job(ending).state == "RUNNING"  # type: ignore[union-attr]
    ending = ending.replace("JobState=RUNNING", "JobState=COMPLETING")
    assert parse_scontrol_job(ending).state == "COMPLETING"  # type: ignore[union-attr]
    # A preemption under way: slurmctld sets PreemptTime (the one line it shows while the grace time runs).
    assert not parse_scontrol_job(HET_RUNNING).preempted  # type: ignore[union-attr]
    preempted = HET_RUNNING.replace("ExitCode=0:0", "ExitCode=0:0 PreemptTime=2026-12-01T12:19:25")
    assert parse_scontrol_job(preempted) == LiveJob("RUNNING", "None", 0, preempted=True)
    cancelled = HET_RUNNING.replace("ExitCode=0:0", "ExitCode=0:0 PreemptTime=None")
    assert not parse_scontrol_job(cancelled).preempted  # type: ignore[union-attr]
    held = "JobId=7 JobName=j JobState=PENDING Reason=job_requeued_in_held_state Requeue=1 Restarts=1\n"
    assert parse_scontrol_job(held).held  # type: ignore[union-attr]
    assert not parse_scontrol_job(HET_REQUEUED).held  # type: ignore[union-attr]
    assert parse_scontrol_job("") is None
    assert count_runs(SACCT_DUPLICATES, "9") == 2 and count_runs("12\n12\n12\n", "12") == 3
    assert count_runs("", "9") == 0


def test_a_requeue_is_not_the_end_and_is_printed_with_its_restart() -> None:
    follower = JobFollower("9")
    seen: list[str] = []
    # What scontrol showed, second by second, while `scontrol requeue 9` ran (sacct not needed meanwhile).
    for observation in (live("PENDING"), live("RUNNING"), live("RUNNING"), live("COMPLETING", 1),
                        live("PENDING", 1, "BeginTime"), live("PENDING", 1, "BeginTime"), live("RUNNING", 1),
                        live("COMPLETED", 1)):
        assert follower.final is None
        seen += follower.observe(observation, None)
    assert seen == ["job 9: PENDING", "job 9: RUNNING", "job 9: requeued (restart 1)", "job 9: COMPLETING",
                    "job 9: PENDING", "job 9: RUNNING", "job 9: COMPLETED"]
    assert follower.final == "COMPLETED" and follower.succeeded


def test_preempted_and_requeued_states_must_last_before_they_end_the_wait() -> None:
    # slurmctld has forgotten the job (or cannot be asked): sacct shows PREEMPTED for the first run a few
    # seconds before the second run's record appears.
    follower = JobFollower("5")
    for _ in range(4):
        follower.observe(None, "PREEMPTED")
    assert follower.final is None
    assert follower.observe(None, "PENDING") == ["job 5: PENDING"] and follower.final is None
    follower.observe(None, "RUNNING")
    assert follower.observe(None, "FAILED") == ["job 5: FAILED"] and follower.final == "FAILED"
    assert not follower.succeeded
    # A PREEMPTED that stays (PreemptMode=CANCEL: no requeue) ends it after SETTLE_POLLS polls.
    cancelled = JobFollower("6")
    for _ in range(JobFollower.SETTLE_POLLS - 1):
        cancelled.observe(live("PREEMPTED"), None)
    assert cancelled.final is None
    cancelled.observe(live("PREEMPTED"), None)
    assert cancelled.final == "PREEMPTED"


def test_sacct_lag_and_a_held_job() -> None:
    follower = JobFollower("3")
    assert follower.observe(None, None) == ["job 3: SUBMITTED"]  # accounting lags behind sbatch
    assert follower.observe(None, "CANCELLED by 0") == ["job 3: CANCELLED by 0"] and follower.final
    held = JobFollower("7")
    held.observe(live("RUNNING"), None)
    lines = held.observe(live("PENDING", 1, "job_requeued_in_held_state"), None)
    assert lines == ["job 7: requeued (restart 1)", "job 7: PENDING (held: job_requeued_in_held_state; "
                     "`scontrol release 7` lets it run again)"]
    assert held.final is not None and not held.succeeded


def test_wait_follows_the_job_and_prints_the_log_at_the_end(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from sfhpc import cli
    from sfhpc.launch import jobs

    views = iter([live("RUNNING"), live("PENDING", 1, "BeginTime"), live("RUNNING", 1), live("COMPLETED", 1)])
    monkeypatch.setattr(jobs, "live_job", lambda job_id: next(views))
    (tmp_path / "slurm-9.out").write_text("0: first run\n0: second run\n")
    assert cli._wait("9", tmp_path, timeout=30, poll_s=0) == 0
    assert capsys.readouterr().out.splitlines() == [
        "job 9: RUNNING", "job 9: requeued (restart 1)", "job 9: PENDING", "job 9: RUNNING", "job 9: COMPLETED",
        "0: first run", "0: second run"]


def fake_slurm(tmp_path: Path, scontrol: str | None, sacct: str, duplicates: str = "") -> dict[str, str]:
    """PATH with stand-in `scontrol` (None: it fails, as for a job slurmctld has forgotten) and `sacct`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    out = tmp_path / "outputs"
    out.mkdir()
    (out / "scontrol").write_text(scontrol or "")
    (out / "sacct").write_text(sacct)
    (out / "duplicates").write_text(duplicates)
    fail = "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1" if scontrol is None else ""
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\n{fail}\ncat {out}/scontrol\n")
    (bin_dir / "sacct").write_text(f'#!/bin/sh\ncase "$*" in *--duplicates*) cat {out}/duplicates;; '
                                   f'*) cat {out}/sacct;; esac\n')
    for tool in ("scontrol", "sacct"):
        (bin_dir / tool).chmod(0o755)
    return {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"}


SACCT_9 = ("9+0|sfhpc-report|train|RUNNING|0:0|n1|00:00:12\n9+1|sfhpc-report|rollout|RUNNING|0:0|n3|00:00:12\n"
           "9+0.batch|batch||RUNNING|0:0|n1|00:00:12\n")


def test_status_shows_restarts_from_scontrol_or_else_from_sacct(tmp_path: Path) -> None:
    done = run_sfhpc("status", "9", "--output-dir", str(tmp_path), env=fake_slurm(tmp_path, HET_REQUEUED, SACCT_9))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "job 9: RUNNING  restarts 1"
    assert "9+1" in done.stdout and "9+0.batch" not in done.stdout
    forgotten = tmp_path / "forgotten"
    forgotten.mkdir()
    env = fake_slurm(forgotten, None, SACCT_9.replace("RUNNING", "COMPLETED"), SACCT_DUPLICATES)
    done = run_sfhpc("status", "9", "--output-dir", str(tmp_path), env=env)
    assert done.returncode == 0 and done.stdout.splitlines()[0] == "job 9: COMPLETED  restarts 1"
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    done = run_sfhpc("status", "9", "--output-dir", str(tmp_path), env=fake_slurm(unknown, None, SACCT_9))
    assert done.returncode == 0 and done.stdout.splitlines()[0] == "job 9: RUNNING"  # restarts unknown: left out


def test_status_bad_input_is_one_line(tmp_path: Path) -> None:
    env = fake_slurm(tmp_path, None, "")
    assert_one_line_error(run_sfhpc("status", "9;rm", env=env), "'9;rm' is not a Slurm job id")
    assert_one_line_error(run_sfhpc("status", "9", env=env), "job 9: sacct knows no such job")


def test_requeue_job_runs_scontrol_and_fails_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sfhpc.errors import SfhpcError, SlurmError
    from sfhpc.launch.jobs import requeue_job

    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    requeue_job("12")
    assert calls.read_text() == "requeue 12\n"
    script.write_text("#!/bin/sh\necho 'scontrol: error: Job has already finished' >&2\nexit 1\n")
    with pytest.raises(SlurmError) as info:
        requeue_job("12")
    assert str(info.value) == "'scontrol requeue 12' failed: scontrol: error: Job has already finished"
    with pytest.raises(SfhpcError, match="is not a Slurm job id"):
        requeue_job("12 13")
