"""Stop requests: a signal only sets a flag; the controller acts on it at the next safe point.

Slurm asks a job to stop in several ways, and on 22.05 they reach different processes:
``SIGTERM`` (preemption, ``scontrol requeue``, a node shutting down) reaches the batch shell and every
rank; ``SIGUSR1``/``SIGUSR2`` come from ``--signal=B:USR1@N`` ahead of the time limit (batch shell only:
the batch script passes it on to the step) or from ``scancel --signal`` (ranks only). Any of them on any
rank means the same: checkpoint and stop.

A handler must do nothing heavy (it runs between two bytecodes of whatever the main thread was doing,
possibly inside an MPI call), so it records the signal's name and returns. Each worker rank's command
loop calls `StopNotice.check`, which tells the controller once; the controller reads its own flag and
the notices in `stop_requested`. Whether the job then requeues is `sfhpc.runtime.requeue`'s decision.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
NOTICE_TAG = 0x5F22  # worker -> controller on the world communicator: "a stop signal reached me"

_received: str | None = None


def _on_signal(signum: int, _frame: object) -> None:
    global _received
    if _received is None:  # the first signal names the request; later ones change nothing
        _received = signal.Signals(signum).name


def install() -> None:
    """Route the stop signals of this process to the flag (main thread only, as Python requires)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _on_signal)


def received() -> str | None:
    """The name of the first stop signal this process got (``"SIGTERM"``...), or None."""
    return _received


def reset() -> None:
    """Forget a received signal (tests)."""
    global _received
    _received = None


class StopNotice:
    """A worker rank's side: tell the controller, once, that a stop signal arrived here."""

    def __init__(self, world: Any, controller_rank: int) -> None:
        self.world, self.controller_rank = world, controller_rank
        self.sent = False

    def check(self) -> None:
        name = received()
        if name is not None and not self.sent:
            self.sent = True
            self.world.send((self.world.Get_rank(), name), dest=self.controller_rank, tag=NOTICE_TAG)


class StopWatch:
    """The controller's side: its own flag, or the first notice any other rank sent."""

    def __init__(self, world: Any) -> None:
        self.world = world
        self.request: tuple[int, str] | None = None  # (rank that got it, signal name)

    def stop_requested(self) -> tuple[int, str] | None:
        if self.request is None and (name := received()) is not None:
            self.request = (self.world.Get_rank(), name)
        from mpi4py import MPI

        while self.world.iprobe(source=MPI.ANY_SOURCE, tag=NOTICE_TAG):  # drain: later notices add nothing
            notice = self.world.recv(source=MPI.ANY_SOURCE, tag=NOTICE_TAG)
            self.request = self.request or tuple(notice)
        return self.request


@contextlib.contextmanager
def ignored_in_children() -> Iterator[None]:
    """Start child processes (vLLM's engine core and workers) that never act on stop signals.

    Slurm signals every process of a step, children included: USR1/USR2 end a process that has no handler,
    and vLLM's engine core shuts itself down on TERM. Either way the engine would die under the rank before
    the safe point (a weight update in progress then fails). The signals are blocked in the calling thread
    while the children start; a blocked mask is inherited by a child and kept across exec (installing a
    handler does not unblock), so they stay blocked there. This process still receives them in its other
    threads: its main thread sets the flag. The engine's owner must end such children with SIGKILL
    (`sfhpc.engine.vllm_engine.VllmEngine.shutdown` does), since they ignore vLLM's own TERM.

    multiprocessing's resource tracker starts first, outside the window: vLLM on CPU starts its engine with
    the ``spawn`` method, whose first use launches the tracker, and launching it *unblocks* INT and TERM in
    the calling thread afterwards (CPython bpo-33613), which would let TERM through to the engine.
    """
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    blocked = set(STOP_SIGNALS)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
