"""The batch script's srun, ended if it outlives every rank of its step.

Slurm 22.05's mpi/pmix plugin can leave ``srun`` waiting forever after a het step is over: every rank
has exited and slurmstepd reported the step done, but srun sits in ``pmixp_abort_agent_stop``, joining
a PMIx abort-agent thread that no longer exists, until the job hits its time limit. Rare (about one het
launch in thirty on the development host), but it turns a finished run into a TIMEOUT.

So the batch script runs srun through this guard:

    python -m sfhpc.launch.step_guard --ranks 4 -- srun --het-group=0,1 ... python -m sfhpc.runtime ...

Every rank, at interpreter exit (after its results are written, before MPI finalizes), leaves a mark:
one small file holding its outcome, in the folder the guard exports as ``$SFHPC_STEP_MARKS``. While
srun runs the guard only watches; srun's own exit status is the guard's. When every rank has left its
mark and srun is still there `grace` seconds later, the guard says so on stderr, ends srun and exits
with the worst outcome the ranks reported. A rank that dies without a mark (killed, crashed) keeps the
guard out of the way: srun's ``--kill-on-bad-exit`` handles that case. Signals the batch shell passes
on (preemption, ``scancel --signal``) are forwarded to srun.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

MARKS_ENV = "SFHPC_STEP_MARKS"
DEFAULT_GRACE_S = 30.0
POLL_S = 1.0
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT)

# What this rank will report in its mark: failure until the rank's program says it finished.
_outcome = 1
_armed = False


def arm(rank: int) -> None:
    """Leave this rank's mark at interpreter exit, if a guard is watching (no-op otherwise)."""
    global _armed
    folder = os.environ.get(MARKS_ENV)
    if not folder or _armed:
        return
    _armed = True
    # Python's atexit handlers run before mpi4py finalizes MPI, and after submitit pickles the results.
    atexit.register(_leave_mark, Path(folder), rank)


def finished(outcome: int = 0) -> None:
    """Record how this rank's program ended (0: success)."""
    global _outcome
    _outcome = outcome


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


def default_marks_folder() -> Path:
    """Per job and restart, next to where the job runs (a folder every node sees, on a cluster)."""
    job = os.environ.get("SLURM_JOB_ID", str(os.getpid()))
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    return Path.cwd() / ".sfhpc-steps" / f"{job}.{restart}"


def guard(command: Sequence[str], ranks: int, grace_s: float = DEFAULT_GRACE_S,
          marks: Path | None = None, poll_s: float = POLL_S) -> int:
    """Run `command` (the job's srun) and return its exit status, or end it once it has outlived all
    `ranks` ranks by `grace_s` seconds and return the ranks' worst outcome."""
    folder = marks or default_marks_folder()
    shutil.rmtree(folder, ignore_errors=True)  # a previous attempt of the same job left its marks
    try:
        folder.mkdir(parents=True)
    except OSError as exc:  # nowhere to put marks: run srun unguarded rather than not at all
        print(f"sfhpc: step guard off (cannot create {folder}: {exc.strerror})", file=sys.stderr, flush=True)
        return subprocess.call(list(command))
    process = subprocess.Popen(list(command), env=dict(os.environ, **{MARKS_ENV: str(folder)}))
    previous = {s: signal.signal(s, lambda signum, _frame: process.send_signal(signum)) for s in _FORWARDED}
    try:
        all_marked_at: float | None = None
        while (status := process.poll()) is None:
            time.sleep(poll_s)
            outcomes = read_marks(folder)
            if len(outcomes) < ranks:
                continue
            all_marked_at = all_marked_at or time.monotonic()
            if time.monotonic() - all_marked_at < grace_s or process.poll() is not None:
                continue
            worst = max(outcomes.values())
            print(f"sfhpc: srun still running {grace_s:.0f} s after all {ranks} ranks exited (outcome {worst}); "
                  "ending it (Slurm mpi/pmix srun hang)", file=sys.stderr, flush=True)
            process.kill()
            process.wait()
            return worst
        return status
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            folder.parent.rmdir()  # only when no other job's marks are in it


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sfhpc.launch.step_guard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, required=True, help="ranks of the step (every het component)")
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_S,
                        help="seconds srun may outlive its last rank before it is ended")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- srun ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.ranks < 1:
        parser.error("usage: python -m sfhpc.launch.step_guard --ranks N -- srun ...")
    return guard(command, args.ranks, args.grace)


if __name__ == "__main__":
    sys.exit(main())
