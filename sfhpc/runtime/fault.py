"""The one fault path of a rank: once the MPI world is up, an exception on any rank ends the whole run.

Without it a rank that fails leaves the others waiting for it: its message stays with it, it exits into
``MPI_Finalize``, which waits for every peer, and the controller waits for an answer that never comes,
for as long as the allocation lasts.

So while a rank's program runs inside `armed`, an exception that leaves the program, or that ends one
of its threads, takes one path (`fail`):

1. one line on stderr, naming the rank, its roles and node, and the error (stderr reaches the console of
   ``sfhpc run`` through mpiexec, and the job's log under srun):
   ``sfhpc: error: rank 2 (rollout, node n3): the agent endpoint cannot listen on ...``;
2. the traceback in the rank's log (``logs/rank-NNN.log``);
3. every rank of the job ended by ``MPI_Abort`` with the exit code, which mpiexec and srun pass on: a
   user error (`SfhpcError`, code 2: a rerun would fail the same way) stays distinct from a fault (1),
   for the step guard's requeue decision (`sfhpc.launch.step_guard`).

Every rank often meets the same error at once (a check each rank makes). A rank other than 0 waits a
moment before it speaks, so that rank 0's line and abort win and the console shows one line; when rank 0
did not fail, the rank prints its own line and aborts after that moment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NoReturn

from sfhpc.errors import SfhpcError
from sfhpc.runtime import step_marks

log = logging.getLogger("sfhpc")

OTHER_RANKS_DELAY_S = 2.0  # rank 0's abort ends the job well within it (about 0.5 s under mpiexec)
FAULT_EXIT = 1  # anything but a user error


@dataclasses.dataclass(frozen=True)
class _Armed:
    rank: int
    label: str  # "rank 2 (rollout, node n3)"
    log_path: Path


_armed: _Armed | None = None
_failing = threading.Lock()  # the first fault of a rank is the one reported; a second waits for the abort


def describe_rank(rank: int, roles: Sequence[str], node: str) -> str:
    """How a line names a rank: ``rank 2 (rollout, node n3)``."""
    return f"rank {rank} ({','.join(roles) or 'no role'}, node {node})"


def exit_code(exc: BaseException) -> int:
    """A user error's own code (2), else `FAULT_EXIT`. A full disk or quota counts as a user error: a
    requeued job would meet it again."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return SfhpcError.exit_code
    return exc.exit_code if isinstance(exc, SfhpcError) else FAULT_EXIT


@contextlib.contextmanager
def armed(rank: int, label: str, log_path: Path) -> Iterator[None]:
    """Inside, an exception that leaves the block, or ends a thread of this process, ends every rank
    through `fail`. The rank must have joined the MPI world (MPI is initialised)."""
    global _armed
    _armed = _Armed(rank, label, log_path)
    previous = threading.excepthook
    threading.excepthook = _thread_failed
    try:
        yield
    except (Exception, KeyboardInterrupt) as exc:
        fail(exc)
    finally:
        threading.excepthook = previous
        _armed = None


def fail(exc: BaseException, thread: str | None = None) -> NoReturn:
    """Report `exc` (one line on stderr, the traceback in the rank's log) and end every rank of the job.
    Callable from any thread; never returns."""
    with _failing:
        where = _armed
        label = "this rank" if where is None else where.label
        if thread is not None:
            label += f", thread {thread}"
        code = exit_code(exc)
        log.error("fault on %s, ending every rank (exit code %d)", label, code, exc_info=exc)
        if where is not None and where.rank != 0:
            time.sleep(OTHER_RANKS_DELAY_S)  # rank 0's own line and abort win if it failed too
        print(f"sfhpc: error: {label}: {one_line(exc, None if where is None else where.log_path)}", file=sys.stderr,
              flush=True)
        sys.stdout.flush()
        step_marks.abandon(code)  # the abort skips atexit, where the guard's mark is left otherwise
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(code)
    raise AssertionError("MPI_Abort returned")  # pragma: no cover


def one_line(exc: BaseException, log_path: Path | None) -> str:
    """A user error's message as it is; anything else with its type and where its traceback went."""
    text = " ".join(str(exc).split())
    if isinstance(exc, SfhpcError):
        return text
    where = f" (traceback in {log_path})" if log_path is not None else ""
    return f"{type(exc).__name__}: {text}{where}" if text else f"{type(exc).__name__}{where}"


def within(seconds: float, action: Callable[[], object], what: str) -> None:
    """Run `action` (a clean-up on the way to `fail`) for at most `seconds`: a clean-up that hangs or raises
    must not keep the fault from being reported. Its own error goes to the log."""
    def run() -> None:
        try:
            action()
        except BaseException as exc:  # noqa: BLE001 - the fault being reported matters, not this one
            log.warning("%s failed on the way to reporting a fault: %s", what, exc, exc_info=exc)

    worker = threading.Thread(target=run, name=f"sfhpc-{what}", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        log.warning("%s did not finish within %.0f s on the way to reporting a fault", what, seconds)


def _thread_failed(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit or args.exc_value is None:
        return
    fail(args.exc_value, thread=None if args.thread is None else args.thread.name)
