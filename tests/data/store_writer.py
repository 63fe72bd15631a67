"""A run's store writer for the crash tests: appends trajectories forever, flushing per batch.

    python -m tests.data.store_writer STORE BATCH [DIE_AT]   (create or reopen STORE; continue its numbering)

After every flush it prints ``flushed N``: trajectories 0..N-1 are then on disk. The test kills it (-9),
or, with DIE_AT, it kills itself in its DIE_AT-th flush after the data is written and before the commit.
"""

from __future__ import annotations

import os
import signal
import sys

from sfhpc.data import store_writer as writer_module
from sfhpc.data.store import TrajectoryStore
from tests.data.records import make_trajectory


def main(argv: list[str]) -> None:
    path, batch = argv[0], int(argv[1])
    store = TrajectoryStore.open(path)
    if len(argv) > 2:
        die_at, commit, flushes = int(argv[2]), writer_module.append_commit, []

        def commit_or_die(*args, **kwargs):
            flushes.append(1)
            if len(flushes) == die_at:
                os.kill(os.getpid(), signal.SIGKILL)  # every data array and table written, no commit row
            commit(*args, **kwargs)

        writer_module.append_commit = commit_or_die
    i = len(store.view())
    print(f"start {i}", flush=True)
    while True:
        for _ in range(batch):
            store.write(make_trajectory(i))
            i += 1
        store.flush()
        print(f"flushed {i}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
