"""The simulated clock: a queue of timed callbacks, run in time order (ties: in the order scheduled)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class EventQueue:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._order = itertools.count()
        self.events = 0  # callbacks run so far
        self._stopped = False

    def at(self, when: float, callback: Callable[[Any], None], arg: Any = None) -> None:
        """Run `callback(arg)` at simulated time `when` (never before now)."""
        heapq.heappush(self._heap, (max(when, self.now), next(self._order), callback, arg))

    def after(self, delay: float, callback: Callable[[Any], None], arg: Any = None) -> None:
        self.at(self.now + delay, callback, arg)

    def stop(self) -> None:
        """End `run` after the callback that calls this."""
        self._stopped = True

    def run(self) -> None:
        """Run events in time order until one calls `stop`, or none are left."""
        heap, pop = self._heap, heapq.heappop
        self._stopped = False
        while heap and not self._stopped:
            when, _, callback, arg = pop(heap)
            self.now = when
            self.events += 1
            callback(arg)
