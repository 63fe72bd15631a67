"""Stop signals only set a flag (the controller acts at the next safe point)."""

from __future__ import annotations

import os
import signal

import pytest

from sfhpc.runtime import preemption


@pytest.fixture(autouse=True)
def handlers():
    saved = {s: signal.getsignal(s) for s in preemption.STOP_SIGNALS}
    preemption.reset()
    yield
    preemption.reset()
    for s, h in saved.items():
        signal.signal(s, h)


@pytest.mark.parametrize("signum", preemption.STOP_SIGNALS)
def test_a_stop_signal_sets_the_flag_and_nothing_else(signum: int) -> None:
    preemption.install()
    assert preemption.received() is None
    os.kill(os.getpid(), signum)  # the process goes on: no exception, no exit
    assert preemption.received() == signal.Signals(signum).name
    os.kill(os.getpid(), signal.SIGUSR1)
    assert preemption.received() == signal.Signals(signum).name  # the first signal names the request


def test_only_the_jobs_own_signals_ask_for_a_requeue() -> None:
    assert preemption.asks_for_requeue("SIGUSR1") and preemption.asks_for_requeue("SIGUSR2")
    assert not preemption.asks_for_requeue("SIGTERM")  # Slurm requeues a preempted job itself


def test_children_started_inside_the_block_do_not_die_of_stop_signals() -> None:
    import subprocess
    import sys

    with preemption.ignored_in_children():
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2); print('alive')"],
                                 stdout=subprocess.PIPE, text=True)
    for signum in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):  # each would end an unprotected child
        child.send_signal(signum)
    out, _ = child.communicate(timeout=10)
    assert child.returncode == 0 and out.strip() == "alive"
