"""What a run is doing right now: one small JSON file in the run folder (``status.json``), replaced at
every change of the controller's phase, for `sfhpc status` and for anyone watching a run (preemption tests
aim their signals with it). Phases: ``starting``, ``resuming``, ``rollout`` (waiting for a batch), ``train``,
``broadcast`` (every engine to the new weights), ``checkpoint``, ``stopping``, ``finished``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from sfhpc.rundir import RunPaths


class LiveStatus:
    """The controller's phase, kept on disk (atomically: a reader never sees half a file)."""

    def __init__(self, run_dir: Path, *, restart: int, job_id: str | None) -> None:
        self.path = RunPaths(run_dir).status
        self.restart, self.job_id = restart, job_id
        self.phase, self.step = "starting", 0
        self.enter("starting", 0)

    def enter(self, phase: str, step: int) -> None:
        self.phase, self.step = phase, step
        row = {"phase": phase, "step": step, "since": time.time(), "restart": self.restart, "job": self.job_id}
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        partial.write_text(json.dumps(row), encoding="utf-8")
        os.replace(partial, self.path)


def read_live_status(run_dir: Path) -> dict[str, Any] | None:
    """The last phase a run's controller entered (None when it wrote none)."""
    try:
        return json.loads(RunPaths(run_dir).status.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
