"""Whole RL runs on one machine: real vLLM engines, real torch training, real MPI, a real HDF5 store.

These are the slowest tests of the suite (each starts vLLM engines, ~30 s), so they use small budgets.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from sfhpc.data.store import open_store
from tests.conftest import run_sfhpc

pytestmark = [pytest.mark.vllm, pytest.mark.mpi]

LEARN = """\
name: learn
seed: 3
model: {warm_start_steps: 40}
algorithm: {name: grpo, group_size: 8, learning_rate: 5.0e-4}
pipeline: {mode: async, max_staleness: 1}
budgets: {steps: STEPS, prompts_per_step: 8}
task: {name: next-letter, options: {letters: "ab"}}
roles:
  controller: {place_with: trainer}
  trainer:    {tags: [train], nodes: 1}
  rollout:    {tags: [rollout], nodes: 1}
"""

COLOCATED = """\
name: colocated
model: {warm_start_steps: 5}
training: {checkpoint_every: 2}
pipeline: {mode: sync}
budgets: {steps: 3, prompts_per_step: 4}
algorithm: {group_size: 4}
task: {name: next-letter}
roles:
  controller: {place_with: trainer}
  trainer:    {tags: [train, rollout], nodes: 1}
  rollout:    {colocate_with: trainer}
"""


def run(tmp_path: Path, text: str) -> tuple[Path, list[dict]]:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text + f"output_dir: {tmp_path / 'runs'}\n")
    done = run_sfhpc("run", str(recipe), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert "reward curve" in done.stdout and "trajectory store:" in done.stdout
    return run_dir, rows


def test_reward_improves_on_a_seeded_run(tmp_path: Path) -> None:
    run_dir, rows = run(tmp_path, LEARN.replace("STEPS", "60"))
    rewards = [r["reward_mean"] for r in rows]
    assert len(rewards) == 60
    first, last = np.mean(rewards[:10]), np.mean(rewards[-10:])
    assert last > first + 0.3 and last > 0.4, rewards
    assert [r["version"] for r in rows] == list(range(1, 61))
    # Async: rollout ran ahead of training, so some trained tokens came from the previous version.
    assert max(r["max_staleness"] for r in rows) == 1
    assert (run_dir / "reward.png").stat().st_size > 1000


def test_colocated_sync_run_records_every_token_with_its_version(tmp_path: Path) -> None:
    run_dir, rows = run(tmp_path, COLOCATED)
    assert [r["version"] for r in rows] == [1, 2, 3]
    assert all(r["max_staleness"] == 0 for r in rows)  # sync: generate with v, train v, publish v+1
    with open_store(run_dir / "trajectories.h5") as store:
        consumed = list(store.trajectories(status="consumed"))
        assert len(consumed) == 3 * 4 * 4
        versions = {int(v) for t in consumed for v in t.token_versions() if v >= 0}
        assert versions == {0, 1, 2}  # step k trained on tokens of version k-1
        assert all(t.reward in (0.0, 1.0) for t in consumed)
        marks = store.marks()
        assert sorted({m.step for m in marks}) == [1, 2, 3]
    report = json.loads((run_dir / "launch_report.json").read_text())
    assert [r["roles"] for r in report["ranks"]] == [["controller"], ["trainer", "rollout"]]
    # Trainer checkpoints every 2 steps and at the end, each with the policy version it holds.
    import torch

    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saved == ["step-000002", "step-000003"]
    state = torch.load(run_dir / "checkpoints" / "step-000003" / "trainer.pt", weights_only=False)
    assert state["policy_version"] == 3 and state["step"] == 3
    manifest = json.loads((run_dir / "checkpoints" / "step-000003" / "MANIFEST.json").read_text())
    assert manifest["step"] == manifest["version"] == 3 and set(manifest["files"]) == {"trainer.pt", "controller.pt"}


MULTI_TURN = """\
name: guess
model: {warm_start_steps: 10}
pipeline: {mode: async, max_staleness: 1}
budgets: {steps: 2, prompts_per_step: 2}
algorithm: {group_size: 4}
task: {name: guess-number, options: {max_turns: 5}}
roles:
  controller: {place_with: trainer}
  trainer:    {tags: [train], nodes: 1}
  rollout:    {tags: [rollout], nodes: 1}
"""


def test_multi_turn_agents_talk_to_the_endpoint_over_http(tmp_path: Path) -> None:
    run_dir, rows = run(tmp_path, MULTI_TURN)
    assert [r["version"] for r in rows] == [1, 2]
    with open_store(run_dir / "trajectories.h5") as store:
        consumed = list(store.trajectories(status="consumed"))
    assert len(consumed) == 2 * 2 * 4
    turns = [len(t.turn_rewards) for t in consumed]  # the agent reports one reward per policy reply
    assert max(turns) > 1  # episodes went on for several turns (hints came back as observations)
    for trajectory, n in zip(consumed, turns):
        observations = [s for s in trajectory.segments if s.kind == "observation"]
        assert len(observations) == n - 1  # one environment answer between consecutive replies
        # at least one generated segment per reply (two when a weight update interrupted the reply)
        assert sum(1 for s in trajectory.segments if s.generated) >= n
