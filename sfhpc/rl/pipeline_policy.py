"""The pipeline policy: what to admit, when a batch is ready, what is too stale, which ranks to lend, reclaim
and rebalance. One pure object (no MPI, no clock, no I/O), asked by the controller (`sfhpc.rl.controller`)
and by the simulator (`sfhpc.sim.pipeline`) alike, so what the simulator measures is what a run does.

Staleness without waste. ``pipeline.max_staleness`` (S) bounds *admission*, as AReaL's staleness manager
does: a group is handed out only while the groups that can still be trained within S versions of their first
token number fewer than ``(S + 1) * prompts_per_step`` (one step's worth in ``sync``). A reply that crosses
weight updates continues on the new weights; every token keeps the version that sampled it, and the loss
corrects each by its own behaviour log-probability (the truncated importance ratio of
`sfhpc.trainer.losses.policy_loss`). So a group with one long reply is trained when it completes, a few
versions late, instead of being thrown away whole (in the simulation at 1,024 GPUs that had been a quarter of
every token generated). A group that still plays and whose oldest token already lags more than S versions
(``overdue``) no longer holds a place in admission: it cannot be trained within the bound any more, and
holding its place would leave engines without work while its last reply finishes. (Counting a group overdue
one version earlier, at S, made seamless 11% faster in the simulation at S = 2, but at S = 1 the bound no
longer held: the trained tokens' mean staleness went from 1.1 to 1.8, as if S were 2.)

A group is dropped for its age only under ``pipeline.max_token_lag`` (off by default): then no trained token
may lag the policy being trained by more than that many versions. A token *newer* than the policy (sampled by
weights a restart lost) is never trained on.

Lending and rebalancing (``seamless``). Trainer ranks that may be lent serve rollouts while the trainer waits
for a batch that is not ready yet, and are reclaimed the moment it is. A lent rank with no work while the
trainer still waits takes half the running sequences of the most loaded rollout ranks, oldest groups
first (they hold the batch back); those continue from their prefix (`rebalance_counts`). New episodes then go
to the rollout ranks only (`new_episodes_to_lent`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, TypeVar

from sfhpc.data import groups

Item = TypeVar("Item", bound=Hashable)
MODES = ("sync", "async", "seamless")


@dataclasses.dataclass(frozen=True)
class PipelinePolicy:
    mode: str                        # sync | async | seamless
    prompts_per_step: int            # GRPO groups per training step
    max_staleness: int = 1           # S: admission keeps up to (S + 1) steps of groups that can train within S
    max_token_lag: int | None = None  # a group with an older token is dropped (None: never, for its age)
    rebalance: bool = True           # seamless: lent ranks that run dry take running sequences of loaded ones
    routes_programs: bool = False    # seamless with agent programs: their episodes move by their generations

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r}: choose from {', '.join(MODES)}")
        if self.prompts_per_step < 1 or self.max_staleness < 0:
            raise ValueError("prompts_per_step must be at least 1 and max_staleness 0 or more")
        if self.max_token_lag is not None and self.max_token_lag < 0:
            raise ValueError("max_token_lag must be 0 or more (or None)")

    @classmethod
    def of(cls, recipe: Any) -> PipelinePolicy:
        """The policy of a recipe (`sfhpc.config.recipe.Recipe`). An agent program's state lives in the program,
        which cannot move: in ``seamless`` its episode moves by its generation instead (`sfhpc.engine.remote`),
        the program staying where it runs, so agent programs' episodes are reclaimed and rebalanced too."""
        pipeline = recipe.pipeline
        return cls(pipeline.mode, recipe.budgets.prompts_per_step, pipeline.max_staleness, pipeline.max_token_lag,
                   rebalance=pipeline.rebalance,
                   routes_programs=pipeline.mode == "seamless" and getattr(recipe, "agent", None) is not None)

    # -- admission -------------------------------------------------------------------------------------
    @property
    def steps_ahead(self) -> int:
        """Steps of groups kept in flight: one (sync), or the staleness bound's S + 1."""
        return 1 if self.mode == "sync" else self.max_staleness + 1

    @property
    def overdue_lag(self) -> int:
        """A group still playing whose oldest token lags this many versions (S + 1) is overdue: it can no
        longer be trained within the bound."""
        return self.max_staleness + 1

    def overdue(self, policy_version: int, oldest: int | None) -> bool:
        """Whether a group that still plays, its oldest token of version `oldest`, is overdue (the trajectory
        manager's rule, `sfhpc.data.groups.overdue`)."""
        return groups.overdue(policy_version, oldest, self.overdue_lag)

    def admit(self, in_flight: int, overdue: int = 0) -> int:
        """How many new groups to hand out now: `in_flight` groups are handed out and not yet trained on or
        dropped, `overdue` of them still play with their oldest token `overdue_lag` versions behind (those
        hold no place; never in ``sync``, which trains every group on the version that generated it)."""
        counted = in_flight - (0 if self.mode == "sync" else min(overdue, in_flight))
        return max(0, self.prompts_per_step * self.steps_ahead - counted)

    # -- batches and staleness ---------------------------------------------------------------------------
    def batch_ready(self, complete_groups: int) -> bool:
        """Whether complete, trainable groups make a step's batch."""
        return complete_groups >= self.prompts_per_step

    def trainable(self, policy_version: int, oldest: int | None, newest: int | None) -> bool:
        """Whether a complete group whose tokens were sampled by versions `oldest`..`newest` (None: no token
        yet) may train `policy_version`: no token newer than it, none older than ``max_token_lag`` allows (the
        trajectory manager's rule, `sfhpc.data.groups.trainable`)."""
        return groups.trainable(policy_version, oldest, newest, self.max_token_lag)

    def hopeless(self, policy_version: int, oldest: int | None) -> bool:
        """Whether a group (complete or still playing) can never be trained: its oldest token already lags
        more than ``max_token_lag`` (versions only grow). Never without that bound."""
        return groups.hopeless(policy_version, oldest, self.max_token_lag)

    # -- lending, reclaiming, rebalancing ---------------------------------------------------------------------
    def to_lend(self, lendable: Sequence[int], lent: Sequence[int], *, batch_ready: bool) -> tuple[int, ...]:
        """The lendable ranks to lend now: every one not lent yet, while the trainer waits for a batch that is
        not ready (lending only to reclaim at once would cost two engine switches for nothing)."""
        if self.mode != "seamless" or batch_ready:
            return ()
        return tuple(r for r in lendable if r not in set(lent))

    def reclaim_now(self, lent: Sequence[int], *, batch_ready: bool) -> bool:
        """Whether the lent ranks go back to the trainer now: the batch is ready."""
        return bool(lent) and batch_ready

    @property
    def new_episodes_to_lent(self) -> bool:
        """Whether newly admitted episodes may go to lent ranks: only without rebalancing. With it, new ones
        go to the rollout ranks and a lent rank takes over running episodes of the oldest groups instead, those
        the batch waits for (in the simulation at 1,024 GPUs: 1.4x the trained tokens/s of lent ranks that
        play new episodes and rebalance only once they run dry)."""
        return not self.rebalances

    @property
    def rebalances(self) -> bool:
        """Whether lent ranks that run dry take work of loaded ones (``seamless`` with ``rebalance``)."""
        return self.mode == "seamless" and self.rebalance

    def rebalance_counts(self, drained: Sequence[int], loads: Mapping[int, int], *,
                         trainer_waits: bool) -> dict[int, int]:
        """How many running sequences lent ranks that ran dry (`drained`) take from which rollout ranks
        (`loads`: rank -> sequences running there): one donor per drained rank, the most loaded first (ties:
        the lower rank), each giving half of its own; a rank with one gives none. Returns donor -> count; the
        donor gives those of its oldest groups (they hold the batch back), which continue from their prefix."""
        if not self.rebalances or not trainer_waits or not drained:
            return {}
        donors = sorted((r for r, n in loads.items() if n >= 2), key=lambda r: (-loads[r], r))
        return {donor: loads[donor] // 2 for donor in donors[:len(drained)]}

    def rebalance_moves(self, drained: Sequence[int], running: Mapping[int, Sequence[tuple[int, Item]]], *,
                        trainer_waits: bool) -> dict[int, list[Item]]:
        """`rebalance_counts` for ranks whose running sequences are known, as (group order, sequence) with
        lower order for older groups: donor -> the sequences to move, oldest groups first."""
        counts = self.rebalance_counts(drained, {r: len(seqs) for r, seqs in running.items()},
                                       trainer_waits=trainer_waits)
        return {donor: [item for _, item in sorted(running[donor], key=lambda entry: entry[0])[:count]]
                for donor, count in counts.items()}
