"""The controller's table of ranks and the assignment of work by tag.

Every rank of the plan has a row: its roles, its node's capability tags, its state and the episodes it
holds. Episodes go to ranks with the ``rollout`` role, fewest episodes in flight first; training goes to ranks with the
``trainer`` role.

The timeline. The scheduler owns every state change of a rank, and each one is an interval boundary on
`self.timeline` (`sfhpc.rl.timeline`): a rank with the rollout role is ``generating`` while it has episodes
in flight and ``waiting`` when it has none (the controller passes on each episode's end: `observe`); a
trainer rank is ``training``, ``syncing``, ``lent`` or ``waiting``. A lent rank with no episode in flight
is on the timeline as ``waiting``: it was lent and had nothing to do. The clock is the constructor's
(``time.time`` for a run; a simulator passes its discrete-event clock).

Lending (``seamless`` mode). A trainer rank whose node carries the ``rollout`` tag holds an engine beside
its trainer; while the trainer waits for a batch the controller `lend`s it (state ``lent``) and episodes
may go to it like to any rollout rank; when the batch is ready the controller `reclaim`s it (back to
``idle``, the trainer's again) and moves its unfinished episodes elsewhere (`withdraw`). A cluster's
admin forbids lending by leaving ``rollout`` off the trainer nodes' tags.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from sfhpc.plan.launch_plan import LaunchPlan
from sfhpc.rl.messages import EpisodeTicket
from sfhpc.rl.timeline import Timeline
from sfhpc.table import format_table


class RankState(enum.StrEnum):
    WAITING = "waiting"  # at rest: a rank with the rollout role and episodes in flight is GENERATING instead
    GENERATING = "generating"
    TRAINING = "training"
    SYNCING = "syncing"
    LENT = "lent"


@dataclasses.dataclass
class RankEntry:
    rank: int
    roles: tuple[str, ...]
    tags: tuple[str, ...]
    state: RankState = RankState.WAITING
    assigned: int = 0  # episodes sent to this rank so far


class Scheduler:
    def __init__(self, plan: LaunchPlan, *, lending: bool = False, clock: Callable[[], float] = time.time,
                 keep_intervals: bool = True) -> None:
        """`lending`: trainer ranks tagged ``rollout`` may be lent to rollout (the recipe's ``seamless``).
        `clock` stamps the timeline's intervals; `keep_intervals=False` keeps only their sums (a simulator
        that wants the bubble fraction, not the intervals)."""
        self.entries = {s.rank: RankEntry(s.rank, s.roles, s.tags) for s in plan.ranks()}
        self._handed = dict.fromkeys(self.entries, 0)  # episodes sent by this process (an allocation)
        # State changes come from the controller's loop and from the manager's serving thread (`observe`).
        self._lock = threading.RLock()
        self._ended: Mapping[int, int] = {}  # the latest episode-end counts the controller passed on
        self.timeline = Timeline(clock, keep_intervals=keep_intervals)
        for rank, entry in self.entries.items():  # the ranks that do the run's work (not the controller)
            if role := timeline_role(entry.roles):
                self.timeline.begin(rank, role, RankState.WAITING)
        self.lending = lending
        self.lends = 0  # times a rank was lent (one per rank per lending), for the run's figures
        self.reclaims = 0  # times a lent rank was taken back

    def add_rank(self, rank: int, tags: Iterable[str]) -> None:
        """A rollout worker of another job joins (`sfhpc.rl.attached`): from now on it takes episodes like any
        rollout rank."""
        with self._lock:
            if rank in self.entries:
                raise ValueError(f"rank {rank} is in the run already")
            self.entries[rank] = RankEntry(rank, ("rollout",), tuple(tags))
            self._handed[rank] = 0
        self.timeline.begin(rank, "rollout", RankState.WAITING)

    def remove_rank(self, rank: int) -> None:
        """A worker of another job left: it takes nothing more (whatever it held was moved or played again)."""
        with self._lock:
            self.entries.pop(rank, None)
            self._handed.pop(rank, None)
        self.timeline.end(rank)

    def ranks_with(self, role: str) -> tuple[int, ...]:
        return tuple(r for r, e in self.entries.items() if role in e.roles)

    @property
    def rollout_ranks(self) -> tuple[int, ...]:
        return self.ranks_with("rollout")

    @property
    def trainer_ranks(self) -> tuple[int, ...]:
        return self.ranks_with("trainer")

    @property
    def lendable_ranks(self) -> tuple[int, ...]:
        """Trainer ranks that may serve rollouts while they wait: their node carries ``rollout`` (a rank
        that already has the rollout role, colocated, is not lent: it rolls out anyway). Empty without
        lending."""
        if not self.lending:
            return ()
        return tuple(r for r, e in self.entries.items()
                     if "trainer" in e.roles and "rollout" in e.tags and "rollout" not in e.roles)

    @property
    def lent_ranks(self) -> tuple[int, ...]:
        return tuple(r for r, e in self.entries.items() if e.state is RankState.LENT)

    @property
    def assignable_ranks(self) -> tuple[int, ...]:
        """Where episodes may go now: the rollout ranks and the ranks lent to rollout."""
        return tuple(sorted(set(self.rollout_ranks) | set(self.lent_ranks)))

    def lend(self, ranks: Iterable[int]) -> tuple[int, ...]:
        """Lend these (lendable, not yet lent) ranks to rollout; returns the ranks newly lent."""
        lendable = set(self.lendable_ranks)
        ranks = tuple(r for r in ranks if self.entries[r].state is not RankState.LENT)
        if refused := [r for r in ranks if r not in lendable]:
            raise ValueError(f"ranks {refused} cannot be lent (not trainer ranks tagged 'rollout', or lending is off)")
        self.set_state(ranks, RankState.LENT)
        self.lends += len(ranks)
        return ranks

    def reclaim(self) -> tuple[int, ...]:
        """Every lent rank back to its trainer (state idle); returns them. The caller moves their unfinished
        episodes to other ranks (and `withdraw`s them from the lent rank's count)."""
        ranks = self.lent_ranks
        self.set_state(ranks, RankState.WAITING)
        self.reclaims += len(ranks)
        return ranks

    def withdraw(self, rank: int, episodes: int) -> None:
        """`episodes` handed to `rank` will not end there (moved elsewhere at a reclaim): they leave its
        count of episodes in flight."""
        with self._lock:
            if rank in self._handed:  # (not for a worker of another job that left)
                self._handed[rank] -= episodes

    def routes(self, counts: Mapping[int, int], among: Iterable[int]) -> dict[int, tuple[int, ...]]:
        """Where the moved generations of each donor rank (`counts`: donor -> how many) would go among the ranks
        `among`: one plan for all of them, each to the least loaded rank as `assign` spreads episodes (ties: the
        lower rank), so that donors moving at once do not all pick the same ranks. Nothing is counted yet: each
        donor routes what it holds of them and the controller `carry`s those it did."""
        with self._lock:
            loads = [(self.in_flight(r, self._ended), r) for r in among if r in self.entries]
            heapq.heapify(loads)
            plan: dict[int, tuple[int, ...]] = {}
            for donor, count in counts.items():
                chosen = []
                for _ in range(count if loads else 0):
                    load, rank = loads[0]
                    heapq.heapreplace(loads, (load + 1, rank))
                    chosen.append(rank)
                plan[donor] = tuple(chosen)
            return plan

    def carry(self, rank: int, episodes: int) -> None:
        """`rank` generates for `episodes` more episodes, whose agent programs play on another rank (their
        generations were routed here, `sfhpc.engine.remote`): they count in its episodes in flight until their
        ends, which count for it."""
        with self._lock:
            if rank in self._handed:
                self._handed[rank] += episodes
        self.observe(self._ended, (rank,))

    def in_flight(self, rank: int, ended: Mapping[int, int]) -> int:
        """Episodes handed to `rank` by this process that have not ended (`ended`: rank -> episodes that
        reported their end, finished or failed, as the trajectory manager's server counts them)."""
        return self._handed.get(rank, 0) - ended.get(rank, 0)

    def assign(self, episodes: Iterable[EpisodeTicket], ended: Mapping[int, int] | None = None, *,
               to_lent: bool = True) -> dict[int, list[EpisodeTicket]]:
        """Spread episodes over the rollout ranks (and the ranks lent to rollout, unless not `to_lent`), each
        to the rank with the fewest episodes in flight (ties: the lower rank). A rank whose episodes run long
        (long replies, many turns) gets fewer new ones."""
        with self._lock:  # (the manager's thread reads the counts in `observe`)
            ended = self._ended if ended is None else ended
            plan: dict[int, list[EpisodeTicket]] = {}
            # (episodes in flight, rank) in a heap: the least loaded rank, ties to the lower one, in log time, so
            # a step's many thousand episodes over thousands of ranks go out in milliseconds.
            ranks = self.assignable_ranks if to_lent else self.rollout_ranks
            loads = [(self.in_flight(r, ended), r) for r in ranks]
            heapq.heapify(loads)
            for episode in episodes:
                if not loads:
                    raise ValueError("no rank takes episodes: the plan has no rollout ranks and none is lent")
                load, rank = loads[0]
                heapq.heapreplace(loads, (load + 1, rank))
                self.entries[rank].assigned += 1
                self._handed[rank] += 1
                plan.setdefault(rank, []).append(episode)
            self._ended = ended
            self.set_state((r for r in plan if self.entries[r].state is not RankState.LENT), RankState.GENERATING)
            self.observe(ended, (r for r in plan if self.entries[r].state is RankState.LENT))
        return plan

    def set_state(self, ranks: Iterable[int], state: RankState) -> None:
        """Put `ranks` in `state` (WAITING and GENERATING: whichever the rank's episodes in flight make true)."""
        with self._lock:
            for rank in ranks:
                entry = self.entries.get(rank)
                if entry is None:  # a worker of another job that left
                    continue
                entry.state = self._at_rest(entry) if state in (RankState.WAITING, RankState.GENERATING) else state
                self._record(entry)

    def was_paused(self, rank: int, start: float, end: float) -> None:
        """`rank`'s engine was paused for a weight update from `start` to `end` (the rank's own account): SYNCING
        on the timeline then, its state otherwise unchanged."""
        with self._lock:
            entry = self.entries.get(rank)
            if entry is not None and timeline_role(entry.roles):
                self.timeline.was(rank, RankState.SYNCING, start, end)

    def observe(self, ended: Mapping[int, int], ranks: Iterable[int] | None = None) -> None:
        """Episodes ended (`ended`: rank -> episodes ended, as `in_flight` takes it): ranks at rest or lent
        whose last episode ended are waiting from now on. `ranks`: only these (default: every rank)."""
        with self._lock:
            self._ended = ended
            for rank in list(self.entries) if ranks is None else ranks:
                entry = self.entries.get(rank)
                if entry is None:  # a worker of another job that left
                    continue
                if entry.state in (RankState.WAITING, RankState.GENERATING):
                    entry.state = self._at_rest(entry)
                    self._record(entry)
                elif entry.state is RankState.LENT:
                    self._record(entry)

    def begin_step(self, step: int) -> None:
        """The run works towards training step `step` now (the timeline stamps it on the intervals)."""
        self.timeline.step = step

    def _at_rest(self, entry: RankEntry) -> RankState:
        busy = "rollout" in entry.roles and self.in_flight(entry.rank, self._ended) > 0
        return RankState.GENERATING if busy else RankState.WAITING

    def _record(self, entry: RankEntry) -> None:
        if not timeline_role(entry.roles):
            return
        state = entry.state
        if state is RankState.LENT and self.in_flight(entry.rank, self._ended) <= 0:
            state = RankState.WAITING  # lent, with nothing to do: a bubble all the same
        self.timeline.change(entry.rank, state)

    def table(self) -> str:
        rows = [(str(e.rank), ",".join(e.roles), ",".join(e.tags), e.state.value, str(e.assigned))
                for e in self.entries.values()]
        return format_table(("rank", "roles", "tags", "state", "episodes"), rows)


def timeline_role(roles: Iterable[str]) -> str:
    """The role a rank has on the timeline: its working roles, comma-joined ("trainer", "rollout",
    "trainer,rollout" for a colocated rank); empty for a rank with neither (the controller)."""
    return ",".join(r for r in roles if r in ("trainer", "rollout"))
