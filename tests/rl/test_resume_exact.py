"""A seeded sync run cut by SIGTERM and resumed ends where the same run uninterrupted ends: the same
per-step rewards and the same weights. In sync mode the safe point is the end of the step in progress,
so the cut changes nothing the run computes (real vLLM, real torch, real MPI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import run_sfhpc
from tests.rl.test_preemption_local import cut_after

pytestmark = [pytest.mark.vllm, pytest.mark.mpi]

SYNC = """\
name: cut
seed: 21
model: {warm_start_steps: 20}
algorithm: {group_size: 4, learning_rate: 5.0e-4}
pipeline: {mode: sync}
budgets: {steps: 5, prompts_per_step: 4}
task: {name: next-letter, options: {letters: "abc"}}
roles:
  controller: {place_with: trainer}
  trainer:    {tags: [train, rollout], nodes: 1}
  rollout:    {colocate_with: trainer}
"""


def outcome(run_dir: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = sorted((run_dir / "checkpoints").iterdir())[-1]
    state = torch.load(final / "trainer.pt", weights_only=False)
    return [r["reward_mean"] for r in rows], state["model"]


def test_a_cut_and_resumed_sync_run_equals_the_uninterrupted_one(tmp_path: Path) -> None:
    whole = tmp_path / "whole"
    whole.mkdir()
    (whole / "r.yaml").write_text(SYNC + f"output_dir: {whole / 'runs'}\n")
    done = run_sfhpc("run", str(whole / "r.yaml"), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    expected_rewards, expected_weights = outcome(next((whole / "runs").iterdir()))

    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "r.yaml").write_text(SYNC + f"output_dir: {cut / 'runs'}\n")
    run_dir, _ = cut_after(cut / "r.yaml", cut / "runs", 2)
    stopped = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()][-1]
    assert stopped["event"] == "stopped" and 2 <= stopped["step"] < 5
    done = run_sfhpc("run", str(cut / "r.yaml"), "--resume", str(run_dir), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rewards, weights = outcome(run_dir)

    assert rewards == expected_rewards
    assert weights.keys() == expected_weights.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected_weights[name], rtol=1e-5, atol=1e-6, msg=name)
