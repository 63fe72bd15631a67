"""DAPO's over-long handling: a soft penalty on replies near their budget, and replies the budget cut left out
of the loss, applied where a batch is made of trajectories."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sfhpc.config import load_recipe
from sfhpc.config.recipe import OverlongSpec
from sfhpc.data.trajectory import Segment, SegmentKind, Status, Trajectory
from sfhpc.errors import ConfigError
from sfhpc.trainer.batch import TrainBatch
from sfhpc.trainer.overlong import Overlong, truncated_turns
from tests.conftest import RECIPES

PROMPT = 5


def episode(i: int, replies: list[tuple[int, str]], reward: float = 1.0) -> Trajectory:
    """A prompt of 5 tokens, then each reply (its length and finish reason), an observation of 2 between."""
    segments = [Segment.of(SegmentKind.PROMPT, -1, 0, range(PROMPT))]
    for k, (n, reason) in enumerate(replies):
        if k:
            segments.append(Segment.of(SegmentKind.OBSERVATION, len(segments) - 1, len(segments[-1]), [7, 7]))
        segments.append(Segment.of(SegmentKind.GENERATED, len(segments) - 1, len(segments[-1]), [9] * n,
                                   logprobs=[-1.0] * n, versions=0, finish_reason=reason, temperature=1.0))
    return Trajectory(id=f"t{i}", segments=tuple(segments), group="g", status=Status.FINISHED, reward=reward)


def test_the_penalty_falls_linearly_over_the_buffer() -> None:
    rule = Overlong.of(OverlongSpec(buffer_tokens=4, penalty=0.5), budget=8)
    assert rule is not None
    assert [rule.length_penalty(n) for n in (3, 4, 5, 6, 8)] == [0.0, 0.0, 0.125, 0.25, 0.5]
    assert Overlong.of(None, 8) is None


def test_a_cut_reply_leaves_the_loss_and_a_long_one_loses_reward() -> None:
    rule = Overlong.of(OverlongSpec(buffer_tokens=4, penalty=1.0, mask_truncated=True), budget=8)
    assert rule is not None
    short, near, cut = episode(0, [(3, "stop")]), episode(1, [(6, "stop")]), episode(2, [(8, "length")])
    # Two replies: the first stopped on its own, the second was cut: only the second leaves the loss.
    two = episode(3, [(3, "stop"), (8, "length")])
    assert [truncated_turns(t) for t in (short, near, cut, two)] == [set(), set(), {0}, {1}]
    batch = TrainBatch.from_trajectories([short, near, cut, two], overlong=rule)
    assert batch.rewards.tolist() == [1.0, 0.5, 0.0, 0.0]  # the longest reply of an episode sets its penalty
    generated = batch.generated.sum(dim=1).tolist()
    assert generated == [3, 6, 0, 3]
    kept = batch.generated[3].numpy()
    assert kept[PROMPT:PROMPT + 3].all() and not kept[PROMPT + 3:].any()
    plain = TrainBatch.from_trajectories([short, near, cut, two])
    assert plain.rewards.tolist() == [1.0] * 4 and plain.generated.sum(dim=1).tolist() == [3, 6, 8, 11]
    # Without mask_truncated the cut reply trains, with its penalty.
    penalty_only = Overlong.of(OverlongSpec(buffer_tokens=4), budget=8)
    assert penalty_only is not None
    shift, keep = penalty_only.shape(cut)
    assert shift == -1.0 and np.asarray(keep).all()


def test_the_recipe_section_is_checked(tmp_path: Path) -> None:
    recipe = load_recipe(RECIPES / "demo.yaml", {"algorithm.overlong": {"buffer_tokens": 4, "mask_truncated": True}})
    assert recipe.algorithm.overlong == OverlongSpec(buffer_tokens=4, penalty=1.0, mask_truncated=True)
    with pytest.raises(ConfigError, match="algorithm.overlong: does nothing"):
        load_recipe(RECIPES / "demo.yaml", {"algorithm.overlong": {"penalty": 1.0}})
    budget = load_recipe(RECIPES / "demo.yaml").budgets.max_new_tokens
    with pytest.raises(ConfigError, match="buffer_tokens: must be less than budgets.max_new_tokens"):
        load_recipe(RECIPES / "demo.yaml", {"algorithm.overlong.buffer_tokens": budget})
