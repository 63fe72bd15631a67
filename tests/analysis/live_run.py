"""A run that is still writing its store, for ``sfhpc traj summary --follow``: a batch of trajectories,
trained on, flushed every `pause` seconds, then the store closed and the ``finished`` event written.
After the first batch it waits for a line on stdin (the reader is ready).

    python -m tests.analysis.live_run RUN_FOLDER BATCHES PAUSE_S
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.store import TrajectoryStore

GROUP = 4


def main(folder: Path, batches: int, pause: float) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    manager = TrajectoryManager(TrajectoryStore.create(folder / "trajectories.h5"))
    for step in range(batches):
        for j in range(GROUP):
            tid = manager.start([1, 2, 3], task="t", group=f"g{step}", trajectory_id=f"s{step}-{j}")
            manager.add_generated(tid, [4, 5, 6], [-0.1] * 3, step)
            manager.finish(tid, reward=float(j % 2))
        assert manager.take_batch(policy_version=step + 1, num_groups=1, group_size=GROUP) is not None
        manager.flush()
        print(f"step {step} flushed", flush=True)
        if step == 0:
            sys.stdin.readline()
        time.sleep(pause)
    manager.close()
    with open(folder / "events.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"event": "finished", "time": time.time(), "step": batches - 1}) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
