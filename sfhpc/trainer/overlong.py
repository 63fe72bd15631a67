"""DAPO's over-long handling (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
section 3.4), applied where the batch is made of trajectories (`TrainBatch.from_trajectories`).

A reply the length budget cut is most often wrong for being long, not for what it says: its reward is noise
about its tokens. Two remedies, each optional (`algorithm.overlong`):

- **Soft over-long punishment.** With the reply budget ``L`` (``budgets.max_new_tokens``, or the task's
  narrower bound) and a buffer ``B`` (``buffer_tokens``), a reply of ``n`` tokens loses

      0                              when n <= L - B
      penalty * (n - (L - B)) / B    when L - B < n <= L

  from its reward: nothing until the buffer, then linearly up to ``penalty`` at the budget. In an episode
  of several replies (each with the same budget) the longest reply sets it.
- **Over-long filtering** (``mask_truncated``). The tokens of every reply whose generation ended at the
  budget (the engine's finish reason ``length``) leave the loss; the episode's other replies stay, and so
  does its reward in its group's advantages.

Rewards are shaped before the advantages, so GRPO compares the shaped rewards within each group. The
store keeps the reward the task gave.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sfhpc.config.recipe import OverlongSpec
from sfhpc.data.trajectory import Trajectory

LENGTH_FINISH = "length"  # the engine's finish reason of a generation its token budget ended


@dataclasses.dataclass(frozen=True)
class Overlong:
    """`OverlongSpec` with the reply budget it measures against."""

    budget: int
    buffer_tokens: int
    penalty: float
    mask_truncated: bool

    @classmethod
    def of(cls, spec: OverlongSpec | None, budget: int) -> Overlong | None:
        if spec is None:
            return None
        return cls(budget=budget, buffer_tokens=min(spec.buffer_tokens, budget), penalty=spec.penalty,
                   mask_truncated=spec.mask_truncated)

    def length_penalty(self, tokens: int) -> float:
        """What a reply of `tokens` tokens loses from its reward (module docstring)."""
        if not self.buffer_tokens:
            return 0.0
        into = tokens - (self.budget - self.buffer_tokens)
        return self.penalty * min(max(into, 0), self.buffer_tokens) / self.buffer_tokens

    def shape(self, trajectory: Trajectory) -> tuple[float, np.ndarray]:
        """`trajectory`'s reward shift (0 or less) and, per token of its context, whether it stays in the loss."""
        spans = trajectory.reply_spans()
        longest = max((sum(used for _, used in span) for span in spans), default=0)
        keep = np.ones(len(trajectory.context()), dtype=bool)
        if self.mask_truncated:
            cut = truncated_turns(trajectory)
            if cut:
                keep = ~np.isin(trajectory.token_turns(), sorted(cut))
        return -self.length_penalty(longest), keep


def truncated_turns(trajectory: Trajectory) -> set[int]:
    """The turns whose reply the length budget ended (its last generation's finish reason)."""
    turns = trajectory.segment_turns()
    return {turns[span[-1][0]] for span in trajectory.reply_spans()
            if trajectory.segments[span[-1][0]].finish_reason == LENGTH_FINISH}
