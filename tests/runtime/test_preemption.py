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


SPAWNED_CHILD = """
import multiprocessing, signal, time
from sfhpc.runtime import preemption

if __name__ == "__main__":
    with preemption.ignored_in_children():  # the first spawn of this process: it launches the tracker too
        child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(3,))
        child.start()
    time.sleep(1)
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        child._popen._send_signal(signum)
    child.join()
    print(child.exitcode)
"""


def test_children_spawned_inside_the_block_do_not_die_of_stop_signals(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """vLLM on CPU starts its engine with multiprocessing's ``spawn``; the first spawn of a process starts
    the resource tracker, which unblocks TERM behind our back unless it was running before the block."""
    import subprocess
    import sys

    script = tmp_path / "spawned_child.py"
    script.write_text(SPAWNED_CHILD)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"  # -15 when TERM got through
