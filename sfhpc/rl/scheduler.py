"""The controller's table of ranks and the assignment of work by tag.

Every rank of the plan has a row: its roles, its node's capability tags, its state and the episodes it
holds. Episodes go to ranks with the ``rollout`` role, fewest episodes in flight first; training goes to ranks with the
``trainer`` role. States make the timeline of a run readable (and, in ``seamless`` mode, say which trainer
ranks may be lent to rollout while they wait).
"""

from __future__ import annotations

import dataclasses
import enum
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
    def __init__(self, plan: LaunchPlan) -> None:
        self.entries = {s.rank: RankEntry(s.rank, s.roles, s.tags) for s in plan.ranks()}
        self._handed = dict.fromkeys(self.entries, 0)  # episodes sent by this process (an allocation)

    def ranks_with(self, role: str) -> tuple[int, ...]:
        return tuple(r for r, e in self.entries.items() if role in e.roles)

    @property
    def rollout_ranks(self) -> tuple[int, ...]:
        return self.ranks_with("rollout")

    @property
    def trainer_ranks(self) -> tuple[int, ...]:
        return self.ranks_with("trainer")

    def in_flight(self, rank: int, ended: Mapping[int, int]) -> int:
        """Episodes handed to `rank` by this process that have not ended (`ended`: rank -> episodes that
        reported their end, finished or failed, as the trajectory manager's server counts them)."""
        return self._handed[rank] - ended.get(rank, 0)

    def assign(self, episodes: Iterable[Episode], ended: Mapping[int, int] | None = None) -> dict[int, list[Episode]]:
        """Spread episodes over the rollout ranks, each to the rank with the fewest episodes in flight (ties:
        the lower rank). A rank whose episodes run long (long replies, many turns) gets fewer new ones."""
        ended = ended or {}
        plan: dict[int, list[Episode]] = {}
        for episode in episodes:
            rank = min(self.rollout_ranks, key=lambda r: (self.in_flight(r, ended), r))
            self.entries[rank].assigned += 1
            self._handed[rank] += 1
            plan.setdefault(rank, []).append(episode)
        for rank in plan:
            self.entries[rank].state = RankState.GENERATING
        return plan

    def set_state(self, ranks: Iterable[int], state: RankState) -> None:
        for rank in ranks:
            self.entries[rank].state = state

    def table(self) -> str:
        rows = [(str(e.rank), ",".join(e.roles), ",".join(e.tags), e.state.value, str(e.assigned))
                for e in self.entries.values()]
        return format_table(("rank", "roles", "tags", "state", "episodes"), rows)
