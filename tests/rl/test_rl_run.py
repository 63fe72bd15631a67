"""A whole RL run on one machine learns: real vLLM engines, real torch training, real MPI, a real HDF5 store.

The suite's learning rise: a seeded ``async`` run whose reward on ``next-letter`` climbs from chance to most
replies right (measured: 0.07 -> 0.84, first and last 6 of 40 steps; 0.98 after 60), and whose greedy evaluation
on held-out problems rises with it (pass@1 0.00, 0.44 at step 20, 1.00 at step 40). Its weights reach the engine
as deltas (``engine.weight_delta``): every version after the first is smaller on the wire than the model, and the
policy still learns what it learned with whole versions. Other whole runs check other things:
a colocated sync run's records `test_resume_exact.py`, multi-turn agents over HTTP `test_preemption_local.py`,
a Hugging Face folder `test_rl_hf_models.py`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sfhpc.data.store import open_store
from tests.conftest import run_recipe

pytestmark = [pytest.mark.vllm, pytest.mark.mpi]

STEPS = 40

LEARN = """\
name: learn
seed: 3
model: {build: {warm_start_steps: 40}}
algorithm: {name: grpo, group_size: 8, learning_rate: 5.0e-4}
pipeline: {mode: async, max_staleness: 1}
engine: {weight_delta: true}
budgets: {steps: STEPS, prompts_per_step: 8}
task: {name: next-letter, options: {letters: "ab"}}
evaluation: {problems: 16, every: 20}
roles:
  controller: {place_with: trainer}
  trainer:    {tags: [train], nodes: 1}
  rollout:    {tags: [rollout], nodes: 1}
"""


def test_reward_improves_on_a_seeded_run(tmp_path: Path) -> None:
    run_dir, every_row = run_recipe(tmp_path, LEARN.replace("STEPS", str(STEPS)))
    rows = [r for r in every_row if "reward_mean" in r]  # the row of step 0 holds the evaluation before training
    rewards = [r["reward_mean"] for r in rows]
    assert len(rewards) == STEPS
    first, last = np.mean(rewards[:10]), np.mean(rewards[-10:])
    assert last > first + 0.3 and last > 0.4, rewards
    assert [r["version"] for r in rows] == list(range(1, STEPS + 1))
    # Async: rollout ran ahead of training, so the trained tokens came from the previous version, step after
    # step. (`max_staleness` bounds admission: a group whose reply crossed an update may train one version later.)
    staleness = [r["max_staleness"] for r in rows]
    assert staleness.count(1) >= len(rows) - 5 and max(staleness) <= 2, staleness
    assert (run_dir / "reward.png").stat().st_size > 1000
    # The first version went whole (the engine's rank held no copy yet), the later ones as deltas (or whole, where
    # every bucket changed too much for an encoding to save bytes): never larger, and most of them smaller.
    sizes = [r["update_bytes"] for r in rows]
    assert sizes[0] > 1e6 and all(0 < size <= sizes[0] for size in sizes[1:]), sizes
    assert sum(size < 0.97 * sizes[0] for size in sizes[1:]) > len(sizes) / 2, sizes
    # Greedy replies to 16 held-out problems, before training, half-way and after the last step: the policy's
    # pass@1 rises with the training reward.
    evaluations = {r["step"]: r["eval_pass_at_1"] for r in every_row if "eval_pass_at_1" in r}
    assert sorted(evaluations) == [0, STEPS // 2, STEPS]
    assert evaluations[STEPS] > evaluations[0] + 0.3, evaluations

    # A run that starts from this one's trained policy (model.init_from) evaluates, before its first step,
    # what this run evaluated after its last: the same greedy replies to the same problems.
    from_run = LEARN.replace("STEPS", "0").replace("model: {build: {warm_start_steps: 40}}",
                                                   f"model: {{init_from: {run_dir}}}")  # evaluates, trains nothing
    (tmp_path / "next").mkdir()
    next_dir, next_rows = run_recipe(tmp_path / "next", from_run)
    assert len(next_rows) == 1 and next_rows[0]["eval_pass_at_1"] == evaluations[STEPS], next_rows
    assert greedy_replies(next_dir, step=0) == greedy_replies(run_dir, step=STEPS)


def greedy_replies(run_dir: Path, *, step: int) -> dict[int, list[int]]:
    """The evaluation after `step`: each problem's reply tokens, by the problem's index."""
    with open_store(run_dir / "trajectories.h5") as store:
        return {int(t.group.rsplit("-p", 1)[1]): [int(x) for x in t.replies()[0][0]] for t in store.trajectories()
                if t.group and t.group.startswith("eval-") and f"-t{step}-p" in t.group}
