"""A tiny rank program for the requeue tests: it writes down every signal it gets and how its run ends.

    python -m tests.launch.signal_probe FOLDER

Each rank appends lines ``restart=R <event>`` to ``FOLDER/rank-N.log``: ``start``, then the name of
every signal that arrives. On its job's first run a rank waits (at most 60 s): after USR1 it exits 0 at
once ("exit after SIGUSR1"); after TERM it finishes 2 s later, inside KillWait ("exit after SIGTERM"), as
a rank writing its checkpoint would. On a later run (a requeue) it exits 0 right after ``start``. It
leaves its step-guard mark like a real rank.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from sfhpc.runtime import step_marks
from sfhpc.runtime.slurm_env import read_rank_environment

WATCHED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def main() -> int:
    folder = Path(sys.argv[1])
    env = read_rank_environment()
    log = folder / f"rank-{env.world_rank}.log"
    got: list[str] = []

    def note(event: str) -> None:
        with log.open("a") as f:
            f.write(f"restart={env.restart_count} {event}\n")

    def on_signal(signum: int, _frame: object) -> None:
        got.append(signal.Signals(signum).name)
        note(got[-1])

    for signum in WATCHED:
        signal.signal(signum, on_signal)
    step_marks.arm(env.world_rank)
    note("start")
    if env.restart_count > 0:
        step_marks.finished(0)
        return 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if "SIGUSR1" in got:
            note("exit after SIGUSR1")
            step_marks.finished(0)
            return 0
        if "SIGTERM" in got:
            time.sleep(2)  # a checkpoint being written
            note("exit after SIGTERM")
            step_marks.finished(0)
            return 0
    note("no signal came")
    return 1


if __name__ == "__main__":
    sys.exit(main())
