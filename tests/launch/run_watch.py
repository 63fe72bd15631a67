"""Watching a run of a Slurm job from the outside, as the preemption tests do: its event log, its metrics,
its live phase, its rank processes, and waiting for one of them to say something. Every wait is on a
condition, bounded by a timeout that only a broken run reaches."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path

from sfhpc.launch.jobs import FINAL_STATES, job_status
from sfhpc.rl.live_status import read_live_status


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


def resumed_in(run_dir: Path, restart: int) -> dict | None:
    """The `resumed` event of allocation `restart` (None before it resumed)."""
    return next((e for e in read_events(run_dir) if e["event"] == "resumed" and e["restart"] == restart), None)


def resumed_after(run_dir: Path, restart: int) -> dict | None:
    """The first `resumed` event of an allocation after allocation `restart` (None before one resumed)."""
    return next((e for e in read_events(run_dir) if e["event"] == "resumed" and e["restart"] > restart), None)


def in_phase(run_dir: Path, restart: int, phase: str, after_step: int, within_s: float) -> dict | None:
    """The live status when allocation `restart` entered `phase` of a step after `after_step` at most
    `within_s` seconds ago (None otherwise): a signal sent now reaches the ranks inside that phase, as
    long as the phase lasts longer than `within_s` plus the signal's way. A weight sync while the run
    resumes (phase ``broadcast``, step `after_step`) is not a step's phase."""
    status = read_live_status(run_dir)
    if (status is not None and status["restart"] == restart and status["phase"] == phase
            and status["step"] > after_step and time.time() - status["since"] < within_s):
        return status
    return None


def job_end_state(job_id: str) -> str | None:
    """The job's final state once sacct shows one (None while it runs or accounting lags). Call it once the
    job's last allocation runs: between two allocations sacct may show the run that ended as PREEMPTED."""
    try:
        state = job_status(job_id).state
    except Exception:  # accounting lags a moment behind the job
        return None
    return state if state.split(" ")[0] in FINAL_STATES else None


def rank_processes(run_dir: Path) -> dict[int, int]:
    """SLURM_PROCID -> pid of the rank processes of a ``sfhpc launch`` run (``python -u -m
    submitit.core._submit RUN_DIR/submitit``), not the children they start (vLLM's engine core inherits
    both the command line, when forked, and the environment)."""
    folder = str(run_dir / "submitit").encode()
    found: dict[int, tuple[int, int]] = {}  # pid -> (procid, parent pid)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = dict(item.split(b"=", 1) for item in (entry / "environ").read_bytes().split(b"\0")
                           if b"=" in item)
            parent = int(re.search(rb"^PPid:\s+(\d+)", (entry / "status").read_bytes(), re.M).group(1))  # type: ignore[union-attr]
        except (OSError, AttributeError):
            continue  # ended meanwhile
        if b"submitit.core._submit" in argv and folder in argv and b"SLURM_PROCID" in environ:
            found[int(entry.name)] = (int(environ[b"SLURM_PROCID"]), parent)
    return {procid: pid for pid, (procid, parent) in found.items() if parent not in found}


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(") ", 1)[1].split()
            except (OSError, IndexError):
                continue  # ended meanwhile
            parents[int(entry.name)] = int(fields[1])
    return parents


def descendants(pid: int) -> set[int]:
    """Every process started under `pid` (children, their children...), still there now."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie has ended)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False
