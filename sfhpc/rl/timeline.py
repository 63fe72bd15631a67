"""The controller's record of every rank's state intervals: the run's timeline.

The scheduler owns every state change of a rank and tells the timeline (`change`); the timeline closes the
rank's open interval and opens the next one at the time its clock says. The clock is injected: the
controller passes `time.time` (the store's times are wall-clock), a simulator passes its discrete-event
clock. Closed intervals wait in `drain` until the trajectory manager's next flush writes them to the
store; the waiting and total rank-seconds per role are summed as intervals close, so `bubble()` costs
nothing however long the run, and `keep_intervals=False` (a simulator that only wants the figures) keeps
no interval at all.

The scheduler changes states from the controller's loop and from the manager's serving thread (an
episode's end), so every method takes the timeline's lock.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from sfhpc.data.rank_intervals import WAITING, BubbleFraction, RankInterval


@dataclasses.dataclass
class _Open:
    role: str
    state: str
    since: float
    step: int


class Timeline:
    def __init__(self, clock: Callable[[], float] = time.time, *, keep_intervals: bool = True) -> None:
        self.clock, self.keep_intervals = clock, keep_intervals
        self.step = 0  # the training step the run works towards; stamped on the intervals that begin now
        self._lock = threading.Lock()
        self._open: dict[int, _Open] = {}
        self._unsaved: list[RankInterval] = []
        self._waiting_s: dict[str, float] = {}
        self._total_s: dict[str, float] = {}
        self.intervals_closed = 0

    def begin(self, rank: int, role: str, state: str) -> None:
        """Start recording `rank` (roles `role`, comma-joined) in `state`, now."""
        with self._lock:
            if rank in self._open:
                raise ValueError(f"rank {rank} is already on the timeline")
            self._open[rank] = _Open(role, str(state), self.clock(), self.step)

    def change(self, rank: int, state: str) -> None:
        """`rank` is in `state` from now on (nothing changes when it already is)."""
        state = str(state)
        with self._lock:
            current = self._open.get(rank)
            if current is None or current.state == state:  # (None: closed, the run is over)
                return
            now = self.clock()
            self._close(rank, current, now)
            self._open[rank] = _Open(current.role, state, now, self.step)

    def was(self, rank: int, state: str, start: float, end: float) -> None:
        """`rank` was in `state` from `start` to `end` (clock times a rank reported after the fact, such as its
        engine's pause for a weight update): the open interval is cut there and goes on after `end`. Times are
        kept inside the open interval and now (another node's clock may run a little apart)."""
        with self._lock:
            current = self._open.get(rank)
            if current is None:
                return
            now = self.clock()
            start = min(max(start, current.since), now)
            end = min(max(end, start), now)
            self._close(rank, current, start)
            self._close(rank, _Open(current.role, str(state), start, current.step), end)
            self._open[rank] = _Open(current.role, current.state, end, current.step)

    def end(self, rank: int) -> None:
        """`rank` leaves the run now (a worker of another job): its open interval ends, later changes are ignored."""
        with self._lock:
            current = self._open.pop(rank, None)
            if current is not None:
                self._close(rank, current, self.clock())

    def state(self, rank: int) -> str:
        with self._lock:
            return self._open[rank].state

    def close(self) -> None:
        """End every open interval now (the run ends); the ranks leave the timeline and later changes are
        not recorded."""
        with self._lock:
            now = self.clock()
            for rank, current in self._open.items():
                self._close(rank, current, now)
            self._open.clear()

    def drain(self) -> list[RankInterval]:
        """The intervals closed since the last call, oldest first (the store's next rows)."""
        with self._lock:
            out, self._unsaved = self._unsaved, []
            return out

    def bubble(self, *, including_open: bool = False) -> BubbleFraction:
        """Waiting rank-seconds / all rank-seconds per role, over the closed intervals (and, with
        `including_open`, the open ones up to now: a live figure)."""
        with self._lock:
            waiting, total = dict(self._waiting_s), dict(self._total_s)
            if including_open:
                now = self.clock()
                for current in self._open.values():
                    _add(waiting, total, current.role, current.state, now - current.since)
            return BubbleFraction(waiting, total)

    def _close(self, rank: int, current: _Open, now: float) -> None:
        seconds = now - current.since
        if seconds <= 0:  # two changes at one instant (a discrete-event clock): no rank-seconds to record
            return
        _add(self._waiting_s, self._total_s, current.role, current.state, seconds)
        self.intervals_closed += 1
        if self.keep_intervals:
            self._unsaved.append(RankInterval(rank, current.role, current.state, current.since, now, current.step))


def _add(waiting: dict[str, float], total: dict[str, float], role: str, state: str, seconds: float) -> None:
    total[role] = total.get(role, 0.0) + seconds
    waiting[role] = waiting.get(role, 0.0) + (seconds if state == WAITING else 0.0)
