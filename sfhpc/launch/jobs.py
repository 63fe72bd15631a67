"""Watch and control submitted jobs: status (from sacct), logs (from the run folder), cancel."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

from sfhpc.errors import SfhpcError, SlurmError
from sfhpc.launch.rundir import find_run_dir
from sfhpc.launch.submitit_het import combine_states
from sfhpc.table import format_table

SACCT_FIELDS = ("JobID", "JobName", "Partition", "State", "ExitCode", "NodeList", "Elapsed")


def slurm_command(args: list[str], timeout: float = 60) -> str:
    """Run a Slurm client command and return its stdout; one-line SlurmError when it is missing or fails."""
    if shutil.which(args[0]) is None:
        raise SlurmError(f"'{args[0]}' not found on PATH: install the Slurm client tools "
                         "(or start the dev cluster with `make cluster-up`)")
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"'{' '.join(args)}' did not answer within {timeout:.0f} s: is slurmctld up?") from None
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()] or ["(no message)"]
        raise SlurmError(f"'{' '.join(args)}' failed: {lines[-1].strip()}")
    return done.stdout


def check_job_id(job_id: str) -> str:
    if not job_id.isdigit():
        raise SfhpcError(f"'{job_id}' is not a Slurm job id (expected a number such as 1234)")
    return job_id


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


def format_status(status: JobStatus, run_dir: Path | None) -> str:
    header = ("component", "partition", "state", "exit", "nodes", "elapsed")
    rows = [(c.job_id, c.partition, c.state, c.exit_code, c.nodes, c.elapsed) for c in status.components]
    title = f"job {status.job_id}: {status.state}" + (f"  (run folder {run_dir})" if run_dir else "")
    return title + "\n" + format_table(header, rows, indent="  ")


def job_logs(job_id: str, output_dir: str, rank: int | None = None) -> str:
    """The batch log of the job (ranks' output labelled ``N:``), or one rank's own log file."""
    check_job_id(job_id)
    run_dir = find_run_dir(output_dir, job_id)
    if run_dir is None:
        raise SfhpcError(f"job {job_id} is not in {Path(output_dir) / 'jobs.tsv'}: pass --output-dir "
                         "with the recipe's output_dir (default: runs)")
    path = run_dir / "logs" / f"rank-{rank:03d}.log" if rank is not None else run_dir / f"slurm-{job_id}.out"
    if not path.exists():
        raise SfhpcError(f"job {job_id}: no log at {path} yet (is the job still pending?)")
    return path.read_text(encoding="utf-8", errors="replace")


def cancel_job(job_id: str) -> None:
    slurm_command(["scancel", check_job_id(job_id)])
