"""A seeded sync run cut by SIGTERM and resumed ends where the same run uninterrupted ends: the same
per-step rewards and the same weights. In sync mode the safe point is the end of the step in progress,
so the cut changes nothing the run computes (real vLLM, real torch, real MPI).

The uninterrupted run is also the check of a colocated sync run's records: every token in the store with
the version that wrote it, each step's consumption marks, the periodic and final checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sfhpc.data.store import open_store
from tests.conftest import run_sfhpc
from tests.rl.test_preemption_local import cut_after

pytestmark = [pytest.mark.vllm, pytest.mark.mpi]

SYNC = """\
name: cut
seed: 21
model: {build: {warm_start_steps: 20}}
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


def check_colocated_records(run_dir: Path) -> None:
    """What a colocated sync run of `SYNC` records: every token with its version, marks, checkpoints."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["max_staleness"] == 0 for r in rows)  # sync: generate with v, train v, publish v+1
    with open_store(run_dir / "trajectories.h5") as store:
        consumed = list(store.trajectories(status="consumed"))
        assert len(consumed) == 5 * 4 * 4
        versions = {int(v) for t in consumed for v in t.token_versions() if v >= 0}
        assert versions == {0, 1, 2, 3, 4}  # step k trained on tokens of version k-1
        assert all(t.reward in (0.0, 1.0) for t in consumed)
        assert sorted({m.step for m in store.marks()}) == [1, 2, 3, 4, 5]
    report = json.loads((run_dir / "launch_report.json").read_text())
    assert [r["roles"] for r in report["ranks"]] == [["controller"], ["trainer", "rollout"]]
    # Checkpoints every 2 steps and at the end, each with the policy version the trainer holds.
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saved == ["step-000002", "step-000004", "step-000005"]
    state = torch.load(run_dir / "checkpoints" / "step-000005" / "trainer.pt", weights_only=False)
    assert state["policy_version"] == 5 and state["step"] == 5
    manifest = json.loads((run_dir / "checkpoints" / "step-000005" / "MANIFEST.json").read_text())
    assert manifest["step"] == manifest["version"] == 5 and set(manifest["files"]) == {"trainer.pt", "controller.json"}


def test_a_cut_and_resumed_sync_run_equals_the_uninterrupted_one(tmp_path: Path) -> None:
    whole = tmp_path / "whole"
    whole.mkdir()
    # Periodic checkpoints change nothing the run computes; the cut run takes only its stop checkpoint.
    (whole / "r.yaml").write_text(SYNC + f"training: {{checkpoint_every: 2}}\noutput_dir: {whole / 'runs'}\n")
    done = run_sfhpc("run", str(whole / "r.yaml"), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    whole_dir = next((whole / "runs").iterdir())
    check_colocated_records(whole_dir)
    expected_rewards, expected_weights = outcome(whole_dir)

    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "r.yaml").write_text(SYNC + f"output_dir: {cut / 'runs'}\n")
    # Each training step held 2 s (its computation unchanged), so that the cut lands after step 2 and
    # before the run's last step even on a loaded machine.
    run_dir, _ = cut_after(cut / "r.yaml", cut / "runs", 2, env={"SFHPC_HOLD_PHASES": "train=2"})
    stopped = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()][-1]
    assert stopped["event"] == "stopped" and 2 <= stopped["step"] < 5
    done = run_sfhpc("run", str(cut / "r.yaml"), "--resume", str(run_dir), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rewards, weights = outcome(run_dir)

    assert rewards == expected_rewards
    assert weights.keys() == expected_weights.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected_weights[name], rtol=1e-5, atol=1e-6, msg=name)
