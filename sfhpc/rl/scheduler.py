"""The controller's table of ranks and the assignment of work by tag.

Every rank of the plan has a row: its roles, its node's capability tags, its state and the episodes it
holds. Episodes go to ranks with the ``rollout`` role, fewest episodes in flight first; training goes to ranks with the
``trainer`` role. States make the timeline of a run readable.

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
from collections.abc import Iterable, Mapping

from sfhpc.launch.resolve import LaunchPlan
from sfhpc.rl.messages import Episode
from sfhpc.table import format_table


class RankState(enum.StrEnum):
    IDLE = "idle"
    GENERATING = "generating"
    TRAINING = "training"
    SYNCING = "syncing"
    LENT = "lent"


@dataclasses.dataclass
class RankEntry:
    rank: int
    roles: tuple[str, ...]
    tags: tuple[str, ...]
    state: RankState = RankState.IDLE
    assigned: int = 0  # episodes sent to this rank so far


class Scheduler:
    def __init__(self, plan: LaunchPlan, *, lending: bool = False) -> None:
        """`lending`: trainer ranks tagged ``rollout`` may be lent to rollout (the recipe's ``seamless``)."""
        self.entries = {s.rank: RankEntry(s.rank, s.roles, s.tags) for s in plan.ranks()}
        self._handed = dict.fromkeys(self.entries, 0)  # episodes sent by this process (an allocation)
        self.lending = lending
        self.lends = 0  # times a rank was lent (one per rank per lending), for the run's figures
        self.reclaims = 0  # times a lent rank was taken back

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
        self.set_state(ranks, RankState.IDLE)
        self.reclaims += len(ranks)
        return ranks

    def withdraw(self, rank: int, episodes: int) -> None:
        """`episodes` handed to `rank` will not end there (moved elsewhere at a reclaim): they leave its
        count of episodes in flight."""
        self._handed[rank] -= episodes

    def in_flight(self, rank: int, ended: Mapping[int, int]) -> int:
        """Episodes handed to `rank` by this process that have not ended (`ended`: rank -> episodes that
        reported their end, finished or failed, as the trajectory manager's server counts them)."""
        return self._handed[rank] - ended.get(rank, 0)

    def assign(self, episodes: Iterable[Episode], ended: Mapping[int, int] | None = None) -> dict[int, list[Episode]]:
        """Spread episodes over the rollout ranks (and the ranks lent to rollout), each to the rank with the
        fewest episodes in flight (ties: the lower rank). A rank whose episodes run long (long replies, many
        turns) gets fewer new ones."""
        ended = ended or {}
        plan: dict[int, list[Episode]] = {}
        # (episodes in flight, rank) in a heap: the least loaded rank, ties to the lower one, in log time, so
        # a step's many thousand episodes over thousands of ranks go out in milliseconds.
        loads = [(self.in_flight(r, ended), r) for r in self.assignable_ranks]
        heapq.heapify(loads)
        for episode in episodes:
            if not loads:
                raise ValueError("no rank takes episodes: the plan has no rollout ranks and none is lent")
            load, rank = loads[0]
            heapq.heapreplace(loads, (load + 1, rank))
            self.entries[rank].assigned += 1
            self._handed[rank] += 1
            plan.setdefault(rank, []).append(episode)
        self.set_state((r for r in plan if self.entries[r].state is not RankState.LENT), RankState.GENERATING)
        return plan

    def set_state(self, ranks: Iterable[int], state: RankState) -> None:
        for rank in ranks:
            self.entries[rank].state = state

    def table(self) -> str:
        rows = [(str(e.rank), ",".join(e.roles), ",".join(e.tags), e.state.value, str(e.assigned))
                for e in self.entries.values()]
        return format_table(("rank", "roles", "tags", "state", "episodes"), rows)
