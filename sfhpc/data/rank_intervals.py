"""A rank's state intervals (the run's timeline, as the store keeps it) and the bubble fraction over them.

Each interval says that one rank was in one state from `t_start` to `t_end`: ``generating`` (a rollout rank
with episodes in flight), ``training``, ``syncing`` (loading or publishing weights), ``lent`` (a trainer
rank serving rollouts) or ``waiting`` (nothing to do). The *bubble fraction* is the share of rank-seconds
spent waiting: waiting rank-seconds / all recorded rank-seconds, overall and per role. A lent rank counts as
busy; what a rank did between intervals (before the run started it, between two sessions of a restarted
run) is not counted at all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np

from sfhpc.data import layout

WAITING = "waiting"
STATES = ("generating", "training", "syncing", "lent", WAITING)
_ROLE_ORDER = ("trainer", "rollout")  # how the per-role figures are listed; other roles follow by name


@dataclasses.dataclass(frozen=True)
class RankInterval:
    """Rank `rank` (roles `role`, comma-joined) was in `state` from `t_start` to `t_end`, during `step`."""

    rank: int
    role: str
    state: str
    t_start: float
    t_end: float
    step: int = 0

    @property
    def seconds(self) -> float:
        return self.t_end - self.t_start


@dataclasses.dataclass(frozen=True)
class BubbleFraction:
    """Waiting and total rank-seconds per role; the fractions follow from them."""

    waiting_s: dict[str, float]
    total_s: dict[str, float]

    @property
    def roles(self) -> list[str]:
        known = [r for r in _ROLE_ORDER if r in self.total_s]
        return known + sorted(r for r in self.total_s if r not in _ROLE_ORDER)

    @property
    def overall(self) -> float | None:
        """Waiting rank-seconds / all rank-seconds (None: nothing recorded)."""
        total = sum(self.total_s.values())
        return sum(self.waiting_s.values()) / total if total > 0 else None

    def of(self, role: str) -> float | None:
        total = self.total_s.get(role, 0.0)
        return self.waiting_s.get(role, 0.0) / total if total > 0 else None

    @property
    def by_role(self) -> dict[str, float | None]:
        return {role: self.of(role) for role in self.roles}

    def format(self) -> str:
        """``37.5% (trainer 50.0%, rollout 25.0%)``; ``not recorded`` when there are no intervals."""
        if self.overall is None:
            return "not recorded"
        parts = ", ".join(f"{role} {_percent(self.of(role))}" for role in self.roles)
        return f"{_percent(self.overall)} ({parts})"

    def as_dict(self) -> dict[str, float | None | dict[str, float | None]]:
        return {"overall": self.overall, "by_role": self.by_role}

    def since(self, earlier: BubbleFraction) -> BubbleFraction:
        """The rank-seconds recorded after `earlier` (a figure of the same timeline taken before this one)."""
        return BubbleFraction({role: self.waiting_s.get(role, 0.0) - earlier.waiting_s.get(role, 0.0)
                               for role in self.total_s},
                              {role: total - earlier.total_s.get(role, 0.0) for role, total in self.total_s.items()})


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def bubble_fraction(roles: Sequence[str] | np.ndarray, states: Sequence[str] | np.ndarray,
                    t_start: Sequence[float] | np.ndarray, t_end: Sequence[float] | np.ndarray) -> BubbleFraction:
    """The bubble fraction of intervals given column by column (as the store's timeline table holds them)."""
    roles, states = np.asarray(roles).astype(str), np.asarray(states).astype(str)
    seconds = np.asarray(t_end, np.float64) - np.asarray(t_start, np.float64)
    waiting_s: dict[str, float] = {}
    total_s: dict[str, float] = {}
    for role in np.unique(roles):
        mine = roles == role
        total_s[str(role)] = float(seconds[mine].sum())
        waiting_s[str(role)] = float(seconds[mine & (states == WAITING)].sum())
    return BubbleFraction(waiting_s, total_s)


def bubble_of(intervals: Iterable[RankInterval]) -> BubbleFraction:
    """The bubble fraction of interval records."""
    rows = to_rows(intervals)
    return bubble_fraction(rows["role"], rows["state"], rows["t_start"], rows["t_end"])


def bubble_of_rows(rows: np.ndarray) -> BubbleFraction:
    """The bubble fraction of the store's timeline rows (``StoreView.table("timeline")``)."""
    return bubble_fraction(np.char.decode(rows["role"], "utf-8"), np.char.decode(rows["state"], "utf-8"),
                           rows["t_start"], rows["t_end"])


def to_rows(intervals: Iterable[RankInterval]) -> np.ndarray:
    """Interval records as timeline table rows."""
    return np.array([(i.rank, i.role.encode(), i.state.encode(), i.t_start, i.t_end, i.step) for i in intervals],
                    dtype=layout.TIMELINE_DTYPE)


def from_rows(rows: np.ndarray) -> list[RankInterval]:
    """Timeline table rows as interval records."""
    return [RankInterval(int(r["rank"]), r["role"].decode(), r["state"].decode(), float(r["t_start"]),
                         float(r["t_end"]), int(r["step"])) for r in rows]
