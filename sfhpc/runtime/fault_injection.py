"""Faults on purpose, for tests that must deliver a signal inside a phase or make a rank fail.

``SFHPC_HOLD_PHASES="train=2,broadcast=2"`` makes every trainer rank wait that many seconds at the start
of each training step, and every rollout rank wait after a new version's header arrived (the broadcast is
then under way on every rank).

``SFHPC_INJECT_FAULTS="play=crash"`` makes a rank fail where a phase begins: ``start`` on every rank
as the RL run begins (the ranks have joined the world), ``train`` at a trainer rank's first training
step, ``play`` when a rank playing episodes (a rollout rank, a lent trainer) gets its first ones.
``crash`` raises a RuntimeError (a fault), ``user-error`` an `SfhpcError` (a user's mistake, exit code
2), ``freeze`` stops the rank's own process with SIGSTOP (it goes silent: no heartbeat, no answer; its
launcher ends it), ``kill`` ends it with SIGKILL (as the kernel's OOM killer would: not a word from the
rank). ``@N`` limits a fault to world rank N: ``play=freeze@2``. ``engine=kill`` kills a rollout rank's engine
processes with SIGKILL (the rank lives on) once its engine holds weights of version 2 or later, 0.1 s into the
next generation that lasts that long: mid-reply, with weights a restart must bring back.

Unset, nothing waits and nothing fails. A test harness sets them; recipes cannot."""

from __future__ import annotations

import functools
import logging
import os
import signal

from sfhpc.errors import SfhpcError

ENV = "SFHPC_HOLD_PHASES"
PHASES = ("train", "broadcast")
FAULTS_ENV = "SFHPC_INJECT_FAULTS"
FAULT_PHASES = ("start", "train", "play", "engine")
FAULTS = ("crash", "user-error", "freeze", "kill")


@functools.cache
def _holds() -> dict[str, float]:
    holds: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in os.environ.get(ENV, "").split(","))):
        phase, _, seconds = item.partition("=")
        if phase not in PHASES:
            raise ValueError(f"{ENV}: unknown phase {phase!r} (phases: {', '.join(PHASES)})")
        holds[phase] = float(seconds)
    return holds


def hold_seconds(phase: str) -> float:
    """How long `phase` is held on this rank (0: not at all)."""
    return _holds().get(phase, 0.0)


@functools.cache
def _faults() -> dict[str, tuple[str, int | None]]:
    faults: dict[str, tuple[str, int | None]] = {}
    for item in filter(None, (part.strip() for part in os.environ.get(FAULTS_ENV, "").split(","))):
        phase, _, what = item.partition("=")
        kind, _, rank = what.partition("@")
        if phase not in FAULT_PHASES or kind not in FAULTS:
            raise ValueError(f"{FAULTS_ENV}: {item!r} is not PHASE=FAULT[@RANK] (phases: {', '.join(FAULT_PHASES)}; "
                             f"faults: {', '.join(FAULTS)})")
        if phase == "engine" and kind != "kill":
            raise ValueError(f"{FAULTS_ENV}: {item!r}: the engine's processes can only be killed (engine=kill)")
        faults[phase] = (kind, int(rank) if rank else None)
    return faults


_struck: set[str] = set()


def engine_fault(rank: int) -> bool:
    """Whether world rank `rank` kills its engine now (``engine=kill``); True once."""
    kind, only = _faults().get("engine", (None, None))
    if kind != "kill" or (only is not None and only != rank) or "engine" in _struck:
        return False
    _struck.add("engine")
    logging.getLogger("sfhpc").warning("rank %d: the engine's processes killed (%s)", rank, FAULTS_ENV)
    return True


def strike(phase: str, rank: int) -> None:
    """Fail here as ``$SFHPC_INJECT_FAULTS`` asks, the first time world rank `rank` reaches `phase`."""
    kind, only = _faults().get(phase, (None, None))
    if kind is None or (only is not None and only != rank) or phase in _struck:
        return
    _struck.add(phase)
    # The moment of the fault, in the rank's log: a test measures how long the run took to end after it.
    logging.getLogger("sfhpc").warning("rank %d: %s injected at %s", rank, kind, phase)
    if kind in ("freeze", "kill"):
        os.kill(os.getpid(), signal.SIGSTOP if kind == "freeze" else signal.SIGKILL)
    elif kind == "user-error":
        raise SfhpcError(f"a user error injected at {phase} ({FAULTS_ENV})")
    else:
        raise RuntimeError(f"a fault injected at {phase} ({FAULTS_ENV})")
