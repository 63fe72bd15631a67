"""Watching a run of a Slurm job from the outside, as the preemption tests do: its event log, its metrics,
its live phase, and waiting for one of them to say something."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path


def wait_until(what: str, probe: Callable[[], object], timeout: float = 420, poll_s: float = 0.25) -> object:
    """The first true value of `probe()`, polled every `poll_s` seconds; fails after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := probe():
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def read_events(run_dir: Path) -> list[dict]:
    return jsonl(run_dir / "events.jsonl")


def steps_in(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def resumed_in(run_dir: Path, restart: int) -> dict | None:
    """The `resumed` event of allocation `restart` (None before it resumed)."""
    return next((e for e in read_events(run_dir) if e["event"] == "resumed" and e["restart"] == restart), None)


def running_in_restart(run_dir: Path, restart: int, own_steps: int = 2) -> bool:
    """Allocation `restart` trains (it resumed, if a restart) and has done `own_steps` steps of its own."""
    events = read_events(run_dir)
    if any(e["event"] == "stop-requested" and e["restart"] == restart for e in events):
        return False
    if restart == 0:
        return steps_in(run_dir) >= own_steps
    resumed = resumed_in(run_dir, restart)
    return resumed is not None and steps_in(run_dir) >= resumed["step"] + own_steps
