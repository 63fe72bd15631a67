"""A long wait for another rank that leaves the CPU to it.

Open MPI's blocking calls poll for progress at full speed, yielding the core between polls, which on a
busy machine still takes most of it. While rank 0 builds and warm-starts sfhpc's own model (minutes on a
CPU), every other rank of a small run waited in a broadcast: on a 2-core machine its two waiting ranks
showed 80-90 % of a core each, and rank 0's warm start ran at a fraction of its speed. So a wait that
may be long sleeps between tests of a non-blocking barrier, and the broadcast runs once all ranks are in.
"""

from __future__ import annotations

import time
from typing import Any, TypeVar

T = TypeVar("T")
POLL_S = 0.05  # a wait of minutes: 50 ms late is nothing, and 20 tests a second cost nothing


def bcast_when_ready(world: Any, value: T, *, root: int = 0, poll_s: float = POLL_S) -> T:
    """`world.bcast(value, root)`, the waiting done asleep: each rank first enters a non-blocking barrier
    and tests it every `poll_s` (the root enters once it holds `value`)."""
    arrived = world.Ibarrier()
    while not arrived.Test():
        time.sleep(poll_s)
    return world.bcast(value, root=root)
