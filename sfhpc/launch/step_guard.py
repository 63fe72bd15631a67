"""The batch script's srun, ended if it outlives every rank of its step.

Slurm 22.05's mpi/pmix plugin can leave ``srun`` waiting forever after a het step is over: every rank
has exited and slurmstepd reported the step done, but srun sits in ``pmixp_abort_agent_stop``, joining
a PMIx abort-agent thread that no longer exists, until the job hits its time limit. Rare (about one het
launch in thirty on the development host), but it turns a finished run into a TIMEOUT.

So the batch script runs srun through this guard:

    python -m sfhpc.launch.step_guard --ranks 4 -- srun --het-group=0,1 ... python -m sfhpc.rank ...

Every rank, at interpreter exit (after its results are written, before MPI finalizes), leaves a mark:
one small file holding its outcome, in the folder the guard exports as ``$SFHPC_STEP_MARKS``. While
srun runs the guard only watches; srun's own exit status is the guard's. When every rank has left its
mark and srun is still there `grace` seconds later (a few seconds once Slurm has sent the job TERM, which
it follows with SIGKILL after KillWait), the guard says so on stderr, ends srun and exits with the worst
outcome the ranks reported. A rank that dies without a mark (killed, crashed) keeps the
guard out of the way: srun's ``--kill-on-bad-exit`` handles that case.

The batch script ``exec``s the guard, so the guard is the batch shell: the signals Slurm sends it (USR1
ahead of the time limit, ``scancel -b --signal``, the TERM of a requeue or preemption) are forwarded to
srun, which forwards them to the ranks, and the guard keeps waiting for srun instead of dying.

With ``--requeue-on-failure N`` a failed step requeues its own job: when srun (or the hang handling)
ends with a status other than 0 and 2 (2: a user error, which a rerun would repeat; a rank's mark saying
2 counts too), no signal came from outside (a cancel, preemption, requeue or time limit: Slurm or the
ranks decide then), and the job has been restarted fewer than N times, the guard says so in one line
and runs ``scontrol requeue``. The job then starts again and resumes from its last checkpoint. The rules
are `sfhpc.runtime.requeue`'s, the one place that decides a requeue.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from sfhpc.errors import SfhpcError
from sfhpc.runtime import requeue
from sfhpc.runtime.requeue import USER_ERROR
from sfhpc.runtime.slurm_env import current_job_id, restart_count
from sfhpc.runtime.step_marks import MARKS_ENV, read_marks

DEFAULT_GRACE_S = 30.0
# The grace once Slurm has sent the job TERM (a requeue, preemption, cancel or node shutdown): Slurm kills the
# batch shell KillWait seconds later (30 by default, 10 on the dev cluster), so a srun that hangs after its
# ranks left is ended soon enough for the shell to exit with the ranks' status before that.
STOPPING_GRACE_S = 3.0
POLL_S = 1.0
# Passed on to srun: the job's own stop requests. Not TERM/INT/HUP: srun answers those by killing the
# step at once ("forcing job termination"), which would take the ranks' checkpoint grace away; when Slurm
# means TERM for the ranks (requeue, preemption, node shutdown) it sends it to them itself.
_FORWARDED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT)
_HELD = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # noted, never the guard's end


def _restarts() -> int:
    try:
        return restart_count()
    except SfhpcError:
        return 0


def default_marks_folder() -> Path:
    """Per job and restart, next to where the job runs (a folder every node sees, on a cluster)."""
    job = current_job_id() or str(os.getpid())
    return Path.cwd() / ".sfhpc-steps" / f"{job}.{_restarts()}"


def guard(command: Sequence[str], ranks: int, grace_s: float = DEFAULT_GRACE_S,
          marks: Path | None = None, poll_s: float = POLL_S, requeue_on_failure: int | None = None) -> int:
    """Run `command` (the job's srun) and return its exit status, or end it once it has outlived all
    `ranks` ranks by `grace_s` seconds and return the ranks' worst outcome. With `requeue_on_failure`,
    a failed step requeues the job (see the module's docstring)."""
    received: list[int] = []
    process: subprocess.Popen[bytes] | None = None

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        if process is not None:
            process.send_signal(signum)  # a no-op once srun has exited

    # Installed before srun starts and kept until the guard returns: a TERM that arrives meanwhile (the
    # one `scontrol requeue` sends, say) is passed on, never the guard's end.
    previous = {s: signal.signal(s, forward) for s in _FORWARDED}
    previous |= {s: signal.signal(s, lambda signum, _frame: received.append(signum)) for s in _HELD}
    try:
        folder = marks or default_marks_folder()
        shutil.rmtree(folder, ignore_errors=True)  # a previous attempt of the same job left its marks
        outcomes: dict[int, int] = {}
        try:
            folder.mkdir(parents=True)
        except OSError as exc:  # nowhere to put marks: run srun unguarded rather than not at all
            print(f"sfhpc: step guard off (cannot create {folder}: {exc.strerror})", file=sys.stderr, flush=True)
            process = subprocess.Popen(list(command))
            status = _shell_status(process.wait())
        else:
            process = subprocess.Popen(list(command), env=dict(os.environ, **{MARKS_ENV: str(folder)}))
            try:
                status = _watch(process, folder, ranks, grace_s, poll_s,
                                stopping=lambda: any(signum in _HELD for signum in received))
                outcomes = read_marks(folder)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
                with contextlib.suppress(OSError):
                    folder.parent.rmdir()  # only when no other job's marks are in it
        stops = [signal.Signals(s).name for s in received if s != signal.SIGCONT]
        _requeue_if_decided(requeue.Situation(
            job_id=current_job_id(), enabled=requeue_on_failure is not None, signal=stops[0] if stops else None,
            exit_status=status,
            # A rank's user error shows in its mark even when srun's status does not (a rank that exits 2
            # makes --kill-on-bad-exit end the others, and srun may report their status instead).
            user_error=USER_ERROR in outcomes.values(),
            restarts=_restarts(), max_restarts=requeue_on_failure or 0))
        return status
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _watch(process: subprocess.Popen[bytes], folder: Path, ranks: int, grace_s: float, poll_s: float,
           stopping: Callable[[], bool] = lambda: False) -> int:
    """srun's exit status, or the ranks' worst outcome once srun has outlived them all by `grace_s` (by
    `STOPPING_GRACE_S` at most once `stopping()`: Slurm is ending the job)."""
    all_marked_at: float | None = None
    while (status := process.poll()) is None:
        time.sleep(poll_s)
        outcomes = read_marks(folder)
        if len(outcomes) < ranks:
            continue
        all_marked_at = all_marked_at or time.monotonic()
        grace = min(grace_s, STOPPING_GRACE_S) if stopping() else grace_s
        if time.monotonic() - all_marked_at < grace or process.poll() is not None:
            continue
        worst = max(outcomes.values())
        print(f"sfhpc: srun still running {grace:.0f} s after all {ranks} ranks exited (outcome {worst}); "
              "ending it (Slurm mpi/pmix srun hang)", file=sys.stderr, flush=True)
        process.kill()
        process.wait()
        return worst
    return _shell_status(status)


def _shell_status(returncode: int) -> int:
    """Popen's -N for "ended by signal N" as a shell reports it (128 + N), so a job's exit code reads right."""
    return 128 - returncode if returncode < 0 else returncode


def _requeue_if_decided(situation: requeue.Situation) -> None:
    """Requeue this job after its step if `sfhpc.runtime.requeue` says so, with its one line."""
    decision = requeue.decide(situation)
    if decision.line is not None:
        print(f"sfhpc: {decision.line}", file=sys.stderr, flush=True)
    if not decision.requeue or situation.job_id is None:
        return
    from sfhpc.runtime.slurm_job import requeue_job  # only now: the guard starts fast without Slurm's helpers

    try:
        requeue_job(situation.job_id)
    except SfhpcError as exc:
        print(f"sfhpc: {exc}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sfhpc.launch.step_guard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, required=True, help="ranks of the step (every het component)")
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_S,
                        help="seconds srun may outlive its last rank before it is ended")
    parser.add_argument("--requeue-on-failure", type=int, metavar="N", default=None,
                        help="requeue the job when the step fails, while it has been restarted fewer than N times")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- srun ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.ranks < 1:
        parser.error("usage: python -m sfhpc.launch.step_guard --ranks N [--requeue-on-failure N] -- srun ...")
    if args.requeue_on_failure is not None and args.requeue_on_failure < 0:
        parser.error("--requeue-on-failure must be 0 (never) or more")
    return guard(command, args.ranks, args.grace, requeue_on_failure=args.requeue_on_failure)


if __name__ == "__main__":
    sys.exit(main())
