"""DAPO's dynamic sampling (``algorithm.filter_groups``): groups without a training signal are kept in the store
as ``filtered``, never trained on, and others are played in their place, up to a bound per step.

The parts: what carries a signal (the trainers' own advantages, shaped and masked), the manager's book
(filtered groups leave it, their tokens counted, each group judged once), the per-step bound and its counts,
the recipe's checks; then a run on the dev machine whose reward makes many groups agree, checked from its
store and its metrics."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from sfhpc.config import load_recipe
from sfhpc.config.recipe import AlgorithmSpec, FilterGroupsSpec
from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.store import TrajectoryStore, open_store
from sfhpc.data.trajectory import Segment, SegmentKind, Status, Trajectory
from sfhpc.errors import ConfigError
from sfhpc.rl.dynamic_sampling import DynamicSampling, has_signal
from sfhpc.trainer.overlong import Overlong
from tests.conftest import RECIPES, ROOT, run_sfhpc

GRPO = AlgorithmSpec(filter_groups=FilterGroupsSpec(max_groups_per_step=3))


def reply(i: int, reward: float, *, tokens: int = 3, reason: str = "stop", turn_rewards: tuple[float, ...] = ()
          ) -> Trajectory:
    segments = (Segment.of(SegmentKind.PROMPT, -1, 0, [1, 2]),
                Segment.of(SegmentKind.GENERATED, 0, 2, [9] * tokens, logprobs=[-1.0] * tokens, versions=0,
                           finish_reason=reason, temperature=1.0))
    return Trajectory(id=f"t{i}", segments=segments, group="g", status=Status.FINISHED, reward=reward,
                      turn_rewards=turn_rewards)


def test_a_group_carries_a_signal_when_a_token_the_loss_takes_has_an_advantage() -> None:
    assert not has_signal([reply(i, 1.0) for i in range(4)], GRPO, None)
    assert not has_signal([reply(i, 0.1) for i in range(3)], GRPO, None)  # their mean is not exactly 0.1
    assert has_signal([reply(i, float(i == 2)) for i in range(4)], GRPO, None)
    assert has_signal([reply(i, float(i == 2)) for i in range(4)], dataclasses.replace(GRPO, normalize_std=False),
                      None)
    # The over-long penalty shapes equal rewards apart: a reply 2 tokens into a 4-token buffer loses half.
    shaping = Overlong(budget=8, buffer_tokens=4, penalty=1.0, mask_truncated=False)
    assert has_signal([reply(0, 1.0, tokens=6), *(reply(i, 1.0) for i in (1, 2))], GRPO, shaping)
    # Every reply the budget cut leaves the loss: whatever their rewards, nothing is left to train.
    masking = Overlong(budget=3, buffer_tokens=0, penalty=1.0, mask_truncated=True)
    cut = [reply(i, float(i), reason="length") for i in range(3)]
    assert has_signal(cut, GRPO, None) and not has_signal(cut, GRPO, masking)
    # Per-turn credit: the episodes agree, their replies' own rewards do not.
    turns = dataclasses.replace(GRPO, credit="turn", turn_reward_weight=1.0)
    assert not has_signal([reply(i, 1.0, turn_rewards=(0.5,)) for i in range(3)], turns, None)
    assert has_signal([reply(i, 1.0, turn_rewards=(float(i),)) for i in range(3)], turns, None)


def play(manager: TrajectoryManager, key: str, rewards: list[float]) -> list[str]:
    manager.book_group(key)
    ids = []
    for j, reward in enumerate(rewards):
        tid = manager.start([1, 2], group=key, trajectory_id=f"{key}-{j}")
        manager.add_generated(tid, [3, 4], [-0.5, -0.5], 0)
        manager.finish(tid, reward=reward)
        ids.append(tid)
    return ids


def test_groups_without_a_signal_leave_the_book_kept_in_the_store(tmp_path: Path) -> None:
    manager = TrajectoryManager(TrajectoryStore.create(tmp_path / "run.h5"))
    judged: list[list[str]] = []

    def judge(group):
        judged.append([t.id for t in group])
        return has_signal(group, GRPO, None)

    manager.judge_groups(judge)
    play(manager, "right", [1.0] * 4)
    mixed = play(manager, "mixed", [1.0, 0.0, 0.0, 1.0])
    play(manager, "wrong", [0.0] * 4)
    assert manager.complete_groups(0, 4) == 1 and manager.complete_groups(0, 4) == 1
    assert manager.take_batch(0, 2, 4) is None  # one group with a signal: not a batch of two
    assert [ids[0] for ids in judged] == ["right-0", "mixed-0", "wrong-0"]  # each judged once, when complete
    assert manager.filtered_groups() == 2 and manager.groups_in_flight() == 1  # the others leave the book
    assert [manager.status(f"right-{j}") for j in range(4)] == ["filtered"] * 4
    assert manager.dropped_tokens()["filtered"] == 2 * 4 * 2
    batch = manager.take_batch(0, 1, 4)
    assert batch is not None and [t.id for t in batch.trajectories] == mixed
    manager.judge_groups(None)  # filtering off: an agreeing group trains
    play(manager, "late", [1.0] * 4)
    assert manager.take_batch(0, 1, 4) is not None and manager.filtered_groups() == 2
    manager.close()
    with open_store(tmp_path / "run.h5") as store:
        assert store.summary().by_status["filtered"] == 8
        assert {t.reward for t in store.trajectories("filtered")} == {0.0, 1.0}  # kept with their rewards


def test_a_step_filters_up_to_its_bound_then_agreeing_groups_fill_the_batch() -> None:
    manager = TrajectoryManager()
    sampling = DynamicSampling.of(GRPO, None, manager)  # 3 groups judged per step, 1 trained
    assert sampling is not None
    sampling.start()
    play(manager, "a", [1.0] * 2)
    sampling.keep_bound(1)
    assert manager.take_batch(0, 1, 2) is None and manager.filtered_groups() == 1
    play(manager, "b", [0.0] * 2)
    sampling.keep_bound(1)
    assert manager.take_batch(0, 1, 2) is None and manager.filtered_groups() == 2
    sampling.keep_bound(1)  # 2 filtered + 1 to train: the bound
    play(manager, "c", [0.0] * 2)
    batch = manager.take_batch(0, 1, 2)
    assert batch is not None and batch.groups[0][0].id == "c-0"
    assert sampling.end_step(batch) == {"groups_played": 3, "groups_filtered": 2, "filter_fallback_groups": 1}
    play(manager, "d", [1.0] * 2)  # the next step filters again, counted from 0
    play(manager, "e", [1.0, 0.0])
    batch = manager.take_batch(0, 1, 2)
    assert batch is not None and batch.groups[0][0].id == "e-0"
    assert sampling.end_step(batch) == {"groups_played": 2, "groups_filtered": 1, "filter_fallback_groups": 0}


def test_the_recipe_section_is_checked() -> None:
    recipe = load_recipe(RECIPES / "demo.yaml", {"algorithm.filter_groups": {}})
    assert recipe.algorithm.filter_groups == FilterGroupsSpec(max_groups_per_step=10 * recipe.budgets.prompts_per_step)
    with pytest.raises(ConfigError, match="filter_groups: needs algorithm.name: grpo"):
        load_recipe(RECIPES / "demo.yaml", {"algorithm.filter_groups": {}, "algorithm.name": "ppo"})
    per_step = recipe.budgets.prompts_per_step
    with pytest.raises(ConfigError, match=rf"max_groups_per_step: must be at least .*prompts_per_step \({per_step}\)"):
        load_recipe(RECIPES / "demo.yaml", {"algorithm.filter_groups.max_groups_per_step": per_step - 1})


# A reply is right when its length is a multiple of 5: about 1 in 5, so 4 answers often all agree (mostly wrong).
FIFTH_REWARD = "def reward(reply, answer):\n    return float(len(reply) % 5 == 0)\n"
DATA = ROOT / "data" / "arith-word"


def test_a_run_trains_only_groups_with_a_signal(tmp_path: Path) -> None:
    (tmp_path / "fifth.py").write_text(FIFTH_REWARD)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""\
name: filtered
seed: 3
engine: {{name: test}}
model: {{build: {{layers: 1, hidden_size: 64, heads: 1}}}}
algorithm: {{group_size: 4, filter_groups: {{max_groups_per_step: 40}}}}
pipeline: {{mode: sync}}
budgets: {{steps: 4, prompts_per_step: 3}}
task:
  name: dataset
  options: {{path: {DATA / 'train.jsonl'}, prompt: question, answer: answer, reward: fifth.py:reward,
             max_reply_tokens: 8}}
roles:
  controller: {{place_with: trainer}}
  trainer: {{tags: [train], nodes: 1}}
  rollout: {{tags: [rollout], nodes: 1}}
output_dir: {tmp_path / 'runs'}
""")
    done = run_sfhpc("run", str(recipe), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    with open_store(run_dir / "trajectories.h5") as store:
        trajectories = list(store.trajectories())
    groups: dict[tuple[str, str], list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault((str(t.status), t.group or t.id), []).append(t)
    trained = [g for (status, _), g in groups.items() if status == "consumed"]
    filtered = [g for (status, _), g in groups.items() if status == "filtered"]
    algorithm = load_recipe(recipe).algorithm
    assert len(trained) == 4 * 3 and all(has_signal(g, algorithm, None) for g in trained)
    assert filtered and all(not has_signal(g, algorithm, None) and len(g) == 4 for g in filtered)
    assert all(len({t.reward for t in g}) > 1 for g in trained)  # no trained batch holds an agreeing group
    assert [r["groups_played"] - r["groups_filtered"] for r in rows] == [3] * 4
    assert sum(r["groups_filtered"] for r in rows) == len(filtered)
    assert not any(r["filter_fallback_groups"] for r in rows)
    assert sum(r["dropped_tokens_filtered"] for r in rows) == sum(t.num_generated for g in filtered for t in g)
