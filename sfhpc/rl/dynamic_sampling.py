"""DAPO's dynamic sampling (Yu et al. 2025, section 3.2): only groups with a training signal are trained on.

GRPO measures each reply against its group: when every reward of a group agrees (all right, all wrong)
every advantage is zero, the group adds nothing to the policy gradient and only dilutes the batch (with
token-mean aggregation it shrinks every other group's weight). With ``algorithm.filter_groups`` such a group
is judged when it is complete, closed ``filtered`` in the store (kept, never trained on) and leaves the
book, so the controller plays another in its place; the step's batch fills with groups that carry a signal.

A group "carries a signal" when some generated token the loss would take has a non-zero advantage: the
judgement runs the trainers' own advantage code (`sfhpc.trainer.losses.algorithm_advantages`) on the batch
the trainer would get (`TrainBatch.from_trajectories`, with the over-long shaping and masking), so it agrees
with the loss for per-turn credit, agents of one episode and shaped rewards alike.

A hard task could keep a step waiting for ever, so a step judges at most ``max_groups_per_step`` groups
(trained and filtered together; DAPO's bound is 10 generation batches): past it, the step stops filtering and
the next complete groups fill its batch as they are (``filter_fallback_groups`` counts those without a
signal). Each step's metrics row says how many groups were played and filtered.
"""

from __future__ import annotations

from collections.abc import Sequence

from sfhpc.config.recipe import AlgorithmSpec, FilterGroupsSpec
from sfhpc.data.groups import Batch
from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.trajectory import Trajectory
from sfhpc.trainer.batch import TrainBatch
from sfhpc.trainer.losses import algorithm_advantages
from sfhpc.trainer.overlong import Overlong

# An advantage below this is rounding (the mean of equal rewards), not a signal.
SIGNAL_FLOOR = 1e-6


def has_signal(group: Sequence[Trajectory], algorithm: AlgorithmSpec, overlong: Overlong | None) -> bool:
    """Whether `group`'s trajectories would move the policy: a generated token the loss takes has an
    advantage above `SIGNAL_FLOOR`."""
    batch = TrainBatch.from_trajectories(group, overlong=overlong)
    advantages = algorithm_advantages(algorithm, batch.rewards, batch.groups, batch.generated, batch.turn_rewards,
                                      batch.reply_turns)
    per_token = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    return bool(((per_token.abs() > SIGNAL_FLOOR) & batch.generated).any())


class DynamicSampling:
    """The controller's side: the manager's judge switched on per step, and the step's counts."""

    def __init__(self, spec: FilterGroupsSpec, algorithm: AlgorithmSpec, overlong: Overlong | None,
                 manager: TrajectoryManager) -> None:
        if spec.max_groups_per_step is None:
            raise ValueError("filter_groups.max_groups_per_step is set when the recipe is loaded")
        self.bound, self.algorithm, self.overlong, self.manager = spec.max_groups_per_step, algorithm, overlong, manager
        self._filtered_before = 0
        self._filtering = False

    @classmethod
    def of(cls, algorithm: AlgorithmSpec, overlong: Overlong | None,
           manager: TrajectoryManager) -> DynamicSampling | None:
        if algorithm.filter_groups is None:
            return None
        return cls(algorithm.filter_groups, algorithm, overlong, manager)

    def judge(self, group: Sequence[Trajectory]) -> bool:
        return has_signal(group, self.algorithm, self.overlong)

    def start(self) -> None:
        """Filtering on, the step's count from zero: when the controller starts, and after each step's row."""
        self._filtered_before = self.manager.filtered_groups()
        self._set(True)

    def keep_bound(self, per_step: int) -> None:
        """While a step waits for its batch: once it filtered so many groups that its `per_step` trained ones
        would pass the bound, filtering stops for the rest of the step."""
        if self._filtering and self.filtered_this_step() + per_step >= self.bound:
            self._set(False)

    def filtered_this_step(self) -> int:
        return self.manager.filtered_groups() - self._filtered_before

    def end_step(self, batch: Batch) -> dict[str, int]:
        """The step's metrics row: the groups played (trained and filtered), filtered, and trained without a
        signal because the bound was reached; then the next step starts counting."""
        filtered = self.filtered_this_step()
        fallback = 0 if self._filtering else sum(not self.judge(g) for g in batch.groups)
        self.start()
        return {"groups_played": len(batch.groups) + filtered, "groups_filtered": filtered,
                "filter_fallback_groups": fallback}

    def _set(self, on: bool) -> None:
        if on != self._filtering:
            self.manager.judge_groups(self.judge if on else None)
            self._filtering = on
