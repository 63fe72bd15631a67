"""Faults fail fast: what stops a run that can no longer make progress, in one line that says why.

The controller runs these checks while it waits for a batch (`Controller.check_health`), the one place
where a run that goes wrong would otherwise wait forever:

* too many failed episodes: more than ``budgets.max_failed_fraction`` of the episodes that ended,
  counted once a step's worth of them has ended (one early failure does not stop a run);
* silence: no rollout rank was heard from for ``budgets.stall_timeout_s`` while episodes are out (a hung
  engine or agent); counted from the start of the wait, so a long training step is not silence;
* a one-way call to the trajectory manager that failed: its caller never learns of it, so it cannot be
  left to a log line.

Each raises a `RunFault`, which reaches the command line as one ``sfhpc: error:`` line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sfhpc.data.service import OneWayFailure
from sfhpc.data.trajectory import Status
from sfhpc.errors import SfhpcError

ENDED = tuple(s.value for s in Status if not s.is_open)  # episodes that ended, well or not


class RunFault(SfhpcError):
    """The run cannot go on: its episodes fail, its rollout ranks went silent, or a recording call failed."""


class TooManyFailures(RunFault):
    pass


class RolloutStalled(RunFault):
    pass


class ManagerCallFailed(RunFault):
    pass


def check_failures(counts: Mapping[str, int], first_reasons: Sequence[str], *, max_fraction: float,
                   min_ended: int) -> None:
    """Raise TooManyFailures when more than `max_fraction` of the ended episodes failed, once at least
    `min_ended` have ended. `counts` are the manager's trajectories per status."""
    failed = counts.get(Status.FAILED.value, 0)
    ended = sum(counts.get(s, 0) for s in ENDED)
    if ended < min_ended or failed <= max_fraction * ended:
        return
    reasons = "; ".join(_one_line(r) for r in first_reasons) or "unknown"
    raise TooManyFailures(
        f"{failed} of the {ended} episodes that ended failed, more than budgets.max_failed_fraction "
        f"({max_fraction:g}); first reasons: {reasons}; fix the agent or task (tracebacks are in the rollout "
        "ranks' logs/rank-NNN.log), or raise budgets.max_failed_fraction")


def check_stall(last_seen: Mapping[int, float], ranks: Sequence[int], *, since: float, now: float,
                timeout_s: float) -> None:
    """Raise RolloutStalled when none of the rollout `ranks` was heard from for `timeout_s` seconds.

    `last_seen` is when each rank's latest request reached the manager, `since` when the wait began
    (both time.monotonic()); a rank is silent from the later of the two.
    """
    silent = {rank: now - max(last_seen.get(rank, since), since) for rank in ranks}
    if not silent or min(silent.values()) < timeout_s:
        return
    names = ", ".join(f"{rank} ({seconds:.0f} s)" for rank, seconds in sorted(silent.items()))
    logs = ", ".join(f"logs/rank-{rank:03d}.log" for rank in sorted(silent))
    raise RolloutStalled(
        f"no trajectory event reached the manager for {min(silent.values()):.0f} s (budgets.stall_timeout_s = "
        f"{timeout_s:g}) while episodes are out; silent rollout ranks: {names}; a hung engine or agent? "
        f"see {logs}; raise budgets.stall_timeout_s if episodes are this slow on purpose")


def check_one_way(failure: OneWayFailure | None) -> None:
    """Raise ManagerCallFailed for the first one-way call to the trajectory manager that failed."""
    if failure is not None:
        raise ManagerCallFailed(
            f"a one-way {failure.method} call from rank {failure.rank} to the trajectory manager failed: "
            f"{_one_line(failure.message)}; its records are incomplete, so the run stops "
            "(details in logs/rank-000.log)")


def _one_line(text: str) -> str:
    return " ".join(text.split())
