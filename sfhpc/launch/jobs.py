"""Watch and control submitted jobs: status (from sacct and slurmctld), logs (from the run folder),
cancel and requeue, and following a job across its requeues.

sacct holds every run of a job but lags a few seconds and shows a requeued run as PREEMPTED or REQUEUED
until the next run's record appears; slurmctld (``scontrol show job``) knows the job's current state and
its restart count at once, but forgets a job some minutes after it ended (MinJobAge). So a job's live
state and restarts come from scontrol while it knows the job, and from sacct after.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sfhpc.errors import SfhpcError, SlurmError
from sfhpc.rundir import RunPaths, find_run_dir
from sfhpc.runtime.slurm_job import (  # noqa: F401  (the job-watching API is launch's too)
    HELD_REASONS,
    HELD_STATES,
    LiveJob,
    check_job_id,
    combine_states,
    live_job,
    parse_scontrol_job,
    preempted_and_running,
    requeue_job,
    slurm_command,
)
from sfhpc.table import format_table

SACCT_FIELDS = ("JobID", "JobName", "Partition", "State", "ExitCode", "NodeList", "Elapsed")
# States after which a job's run will not change any more (PREEMPTED: when slurmctld shows it, the job
# is not requeued; a requeued job goes back to PENDING).
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED")


@dataclasses.dataclass(frozen=True)
class ComponentStatus:
    job_id: str          # "123+0" for a het component, "123" for a plain job
    name: str
    partition: str
    state: str
    exit_code: str
    nodes: str
    elapsed: str


@dataclasses.dataclass(frozen=True)
class JobStatus:
    job_id: str
    state: str
    components: tuple[ComponentStatus, ...]


def job_status(job_id: str) -> JobStatus:
    """The job's components and combined state, from sacct (job steps are left out)."""
    check_job_id(job_id)
    out = slurm_command(["sacct", "-j", job_id, "--parsable2", "--noheader", "-o", ",".join(SACCT_FIELDS)])
    parts = []
    for line in out.splitlines():
        fields = line.split("|")
        if len(fields) != len(SACCT_FIELDS) or "." in fields[0]:
            continue
        parts.append(ComponentStatus(*fields))
    if not parts:
        raise SfhpcError(f"job {job_id}: sacct knows no such job (accounting may lag a second behind sbatch)")
    return JobStatus(job_id, combine_states([p.state for p in parts]), tuple(parts))


def format_status(status: JobStatus, run_dir: Path | None, restarts: int | None = None,
                  live: Mapping[str, Any] | None = None) -> str:
    """The job's table; `live` is the run's last phase (`sfhpc.rl.live_status`), shown while it runs."""
    header = ("component", "partition", "state", "exit", "nodes", "elapsed")
    rows = [(c.job_id, c.partition, c.state, c.exit_code, c.nodes, c.elapsed) for c in status.components]
    title = f"job {status.job_id}: {status.state}"
    title += f"  restarts {restarts}" if restarts is not None else ""
    title += f"  (run folder {run_dir})" if run_dir else ""
    if live is not None and status.state == "RUNNING":
        title += f"\n  phase {live['phase']} at step {live['step']} (allocation {live['restart']})"
    return title + "\n" + format_table(header, rows, indent="  ")


def count_runs(sacct_duplicates: str, job_id: str) -> int:
    """Runs of a job in `sacct -D -X -o JobID` output: one record per run (of component 0 for a het job)."""
    return sum(1 for line in sacct_duplicates.split() if line.strip() in (job_id, f"{job_id}+0"))


def job_restarts(job_id: str) -> int | None:
    """How often the job was requeued: from slurmctld, else from sacct's records of every run; None when
    neither knows."""
    live = live_job(job_id)
    if live is not None:
        return live.restarts
    try:
        out = slurm_command(["sacct", "-j", check_job_id(job_id), "--duplicates", "-X", "--noheader",
                             "--parsable2", "-o", "JobID"])
    except SlurmError:
        return None
    runs = count_runs(out, job_id)
    return runs - 1 if runs else None


class JobFollower:
    """Follows one job across its requeues (``sfhpc launch --wait``).

    Feed it what Slurm says on every poll; it returns the lines worth printing (each state change, and
    ``requeued (restart N)`` when the restart count grows) and sets `final` once the latest run is over
    for good. PREEMPTED and REQUEUED runs of a requeued job are not the end: it is pending again. A job
    held after a requeue ends the wait too, since only a person can release it.
    """

    # Polls a PREEMPTED or REQUEUED state must last before it counts as the end: a requeued job is
    # pending again within seconds (and its next sacct record appears a few seconds after that).
    SETTLE_POLLS = 15

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.state = ""
        self.restarts = 0
        self.final: str | None = None
        self._same = 0  # polls the current state has lasted

    def observe(self, live: LiveJob | None, accounted: str | None) -> list[str]:
        """`live`: slurmctld's view (None when it does not know the job); `accounted`: the latest run's
        state from sacct (None when sacct has no record yet)."""
        lines: list[str] = []
        if live is not None:
            state = live.state
            if live.restarts > self.restarts:
                self.restarts = live.restarts
                lines.append(f"job {self.job_id}: requeued (restart {self.restarts})")
            if live.held:
                state = f"{state} (held: {live.reason or state}; `scontrol release {self.job_id}` lets it run again)"
        else:
            # slurmctld has forgotten the job (or cannot be asked): sacct's latest run is all there is.
            state = accounted or "SUBMITTED"  # accounting lags a moment behind sbatch
        self._same = self._same + 1 if state == self.state else 1
        word = state.split()[0]
        if live is not None and live.held:
            self.final = state
        elif word in ("PREEMPTED", "REQUEUED"):
            if self._same >= self.SETTLE_POLLS:
                self.final = state
        elif word in FINAL_STATES:
            self.final = state
        if state != self.state:
            lines.append(f"job {self.job_id}: {state}")
            self.state = state
        return lines

    @property
    def succeeded(self) -> bool:
        return self.final == "COMPLETED"


def job_logs(job_id: str, output_dir: str, rank: int | None = None) -> str:
    """The batch log of the job (ranks' output labelled ``N:``), or one rank's own log file."""
    check_job_id(job_id)
    run_dir = find_run_dir(output_dir, job_id)
    if run_dir is None:
        raise SfhpcError(f"job {job_id} is not in {Path(output_dir) / 'jobs.tsv'}: pass --output-dir "
                         "with the recipe's output_dir (default: runs)")
    paths = RunPaths(run_dir)
    path = paths.rank_log(rank) if rank is not None else paths.slurm_log(job_id)
    if not path.exists():
        raise SfhpcError(f"job {job_id}: no log at {path} yet (is the job still pending?)")
    return path.read_text(encoding="utf-8", errors="replace")


def cancel_job(job_id: str) -> None:
    slurm_command(["scancel", check_job_id(job_id)])
