"""A controller for the crash tests: a trajectory manager writing groups in every state, forever.

    python -m tests.data.manager_writer STORE

Round k starts group g{k} of four trajectories k{k}-0..3 (prompt of 20 tokens, 30 generated at version
k): 0 and 1 finish, 2 is interrupted, 3 stays running. After each round it flushes and prints ``flushed k``.
"""

from __future__ import annotations

import sys

from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.store import TrajectoryStore


def prompt(k: int, j: int) -> list[int]:
    return [1000 * k + 10 * j + t for t in range(20)]


def generated(k: int, j: int) -> list[int]:
    return [7 + k + j + t for t in range(30)]


def main(argv: list[str]) -> None:
    manager = TrajectoryManager(TrajectoryStore.create(argv[0]), flush_every=1000)
    k = 0
    print("start 0", flush=True)
    while True:
        for j in range(4):
            tid = manager.start(prompt(k, j), task="crash", group=f"g{k}", trajectory_id=f"k{k}-{j}")
            manager.add_generated(tid, generated(k, j), [-0.5] * 30, k, engine="rank-1")
            if j < 2:
                manager.finish(tid, reward=float(j))
            elif j == 2:
                manager.interrupt(tid)
        manager.flush()
        print(f"flushed {k}", flush=True)
        k += 1


if __name__ == "__main__":
    main(sys.argv[1:])
