"""Stretching a phase of the RL loop on purpose, for tests that must deliver a signal inside it.

``SFHPC_HOLD_PHASES="train=2,broadcast=2"`` makes every trainer rank wait that many seconds at the start
of each training step, and every rollout rank wait after a new version's header arrived (the broadcast is
then under way on every rank). Unset, nothing waits. A test harness sets it; recipes cannot."""

from __future__ import annotations

import functools
import os

ENV = "SFHPC_HOLD_PHASES"
PHASES = ("train", "broadcast")


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
