"""The mark every rank leaves for the step guard (`sfhpc.launch.step_guard`) when its program ends.

Every rank, at interpreter exit (after its results are written, before MPI finalizes), leaves one small
file holding its outcome, in the folder the guard exports as ``$SFHPC_STEP_MARKS``. The guard reads the
marks to tell a step whose ranks have all finished (and whose srun hangs) from one still running, and a
user error (no requeue) from a failure. Outside a guarded step (no ``$SFHPC_STEP_MARKS``) nothing is left.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path

MARKS_ENV = "SFHPC_STEP_MARKS"

# What this rank will report in its mark: failure until the rank's program says it finished.
_outcome = 1
_armed: tuple[Path, int] | None = None  # (marks folder, rank) once armed


def arm(rank: int) -> None:
    """Leave this rank's mark at interpreter exit, if a guard is watching (no-op otherwise)."""
    global _armed
    folder = os.environ.get(MARKS_ENV)
    if not folder or _armed:
        return
    _armed = (Path(folder), rank)
    # Python's atexit handlers run before mpi4py finalizes MPI, and after submitit pickles the results.
    atexit.register(_leave_mark, Path(folder), rank)


def finished(outcome: int = 0) -> None:
    """Record how this rank's program ended (0: success)."""
    global _outcome
    _outcome = outcome


def abandon(outcome: int) -> None:
    """Record `outcome` and leave the mark now: the process is about to end without its atexit handlers
    (`MPI_Abort`, `sfhpc.runtime.fault`), and a user error must still keep the guard from requeueing."""
    finished(outcome)
    if _armed is not None:
        _leave_mark(*_armed)


def _leave_mark(folder: Path, rank: int) -> None:
    try:
        temporary = folder / f".rank-{rank}.tmp"
        temporary.write_text(f"{_outcome}\n")
        temporary.replace(folder / f"rank-{rank}")  # whole or absent: the guard never reads half a mark
    except OSError:
        pass  # the folder is gone (the guard already returned): nothing is watching


def read_marks(folder: Path) -> dict[int, int]:
    """Rank -> outcome of every mark in `folder`."""
    marks: dict[int, int] = {}
    for path in folder.glob("rank-*"):
        try:
            marks[int(path.name.removeprefix("rank-"))] = int(path.read_text().strip() or 1)
        except (OSError, ValueError):
            continue
    return marks
