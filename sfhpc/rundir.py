"""Run folders and the job index.

Every run writes into one folder: ``<output_dir>/<recipe>-<UTC time>`` for ``sfhpc launch`` and
``sfhpc run``, ``<output_dir>/<recipe>-job<JOBID>`` for a job started from an sbatch template (a
requeued job keeps its id, so it finds its folder again). ``<output_dir>/jobs.tsv`` maps job ids to
run folders, so that ``sfhpc status|logs JOB`` can find them.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import os
from pathlib import Path

INDEX_NAME = "jobs.tsv"


def new_run_dir(output_dir: str | Path, recipe_name: str) -> Path:
    """Create and return a fresh, absolute run folder (never one that exists)."""
    base = Path(output_dir).absolute()
    base.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    for suffix in ["", *(f"-{i}" for i in range(1, 1000))]:
        path = base / f"{recipe_name}-{stamp}{suffix}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"cannot create a run folder under {base}")


def job_run_dir(output_dir: str | Path, recipe_name: str, job_id: str) -> Path:
    return Path(output_dir).absolute() / f"{recipe_name}-job{job_id}"


def record_job(output_dir: str | Path, job_id: str, run_dir: Path, recipe_source: str) -> None:
    """Append ``job_id -> run_dir`` to the index (a lock keeps concurrent writers' lines whole)."""
    index = Path(output_dir).absolute() / INDEX_NAME
    index.parent.mkdir(parents=True, exist_ok=True)
    line = f"{job_id}\t{run_dir}\t{recipe_source}\t{dt.datetime.now(dt.UTC).isoformat()}\n"
    with open(index, "a", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def find_run_dir(output_dir: str | Path, job_id: str) -> Path | None:
    """The run folder of `job_id` from the index, or None."""
    index = Path(output_dir) / INDEX_NAME
    if not index.exists():
        return None
    found = None
    for line in index.read_text(encoding="utf-8").splitlines():
        fields = line.split("\t")
        if len(fields) >= 2 and fields[0] == job_id:
            found = Path(fields[1])
    return found
