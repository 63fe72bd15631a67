"""On-policy distillation under `sfhpc launch` on the dev cluster: the teacher role on a node of its own (its own
het component, beside the trainer's and the rollout's), real vLLM, real torch, pure distillation
(``task_reward: false``: the task's reward is recorded, never trained on). The student is a 2-layer model
warm-started on arith-word's reply format (right about 1 time in 4), the teacher a 4-layer one warm-started on
the right solutions (`tests.rl.distill_models`). Over the run the student's reverse KL to the teacher falls and
its reward rises towards the teacher's, which only the teacher's scores can have taught it (measured here, 36
steps: KL 0.58 -> 0.35 per token, sampled reward 0.25 -> 0.52 over the first and last 10 steps, greedy pass@1 on
held-out rows 0.26 -> 0.76, the teacher's 1.00; in 45 steps: 0.57 -> 0.24, 0.25 -> 0.62, 0.26 -> 1.00); the
teacher's log-probabilities of every trained trajectory are in the store, and they are the teacher's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from sfhpc.data.store import open_store
from sfhpc.trainer.batch import TrainBatch
from sfhpc.trainer.teacher import TeacherScorer
from tests.conftest import RECIPES, run_sfhpc
from tests.rl.distill_models import build_pair

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]

STEPS = 36


def recipe(train: Path, student: Path, teacher: Path, out: Path) -> str:
    return f"""\
name: distill-on-slurm
seed: 1
model: {{path: {student}}}
algorithm:
  group_size: 4
  learning_rate: 6.0e-4
  distill: {{teacher: {teacher}, task_reward: false}}
pipeline: {{mode: sync}}
budgets: {{steps: {STEPS}, prompts_per_step: 16}}
task:
  name: dataset
  options: {{path: {train}, prompt: question, answer: answer, reward: numeric, max_reply_tokens: 10}}
evaluation: {{path: {train.parent / 'test.jsonl'}, every: {STEPS}}}
roles:
  controller: {{place_with: trainer}}
  trainer:    {{tags: [train], nodes: 1}}
  rollout:    {{tags: [rollout], nodes: 1}}
  teacher:    {{tags: [train], nodes: 1}}
launch: {{time_minutes: 15}}
output_dir: {out}
"""


def test_a_student_learns_from_a_teacher_on_a_node_of_its_own(slurm_cluster: str, tmp_path: Path) -> None:
    train, student, teacher = build_pair(tmp_path)
    path = tmp_path / "distill.yaml"
    path.write_text(recipe(train, student, teacher, tmp_path / "runs"))
    done = run_sfhpc("launch", str(path), "--cluster", str(RECIPES / "cluster-dev.yaml"), "--wait", "--timeout", "600",
                     timeout=660)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    report = json.loads((run_dir / "launch_report.json").read_text())
    ranks = {r["roles"][0]: r for r in report["ranks"]}
    # The teacher is a component of its own: a node that neither the trainer nor the rollout rank runs on.
    assert sorted(ranks) == ["controller", "rollout", "teacher", "trainer"]
    assert ranks["teacher"]["component"] not in (ranks["trainer"]["component"], ranks["rollout"]["component"])
    assert len({ranks[role]["node"] for role in ("teacher", "trainer", "rollout")}) == 3

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "distill_kl" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    first, last = steps[:10], steps[-10:]

    def mean(key: str, of: list[dict[str, float]]) -> float:
        return sum(r[key] for r in of) / len(of)

    kl_before, kl_after = mean("distill_kl", first), mean("distill_kl", last)
    reward_before, reward_after = mean("reward_mean", first), mean("reward_mean", last)
    assert kl_after < 0.8 * kl_before, (kl_before, kl_after)
    assert reward_after > reward_before + 0.15, (reward_before, reward_after)
    evaluations = [r["eval_pass_at_1"] for r in rows if "eval_pass_at_1" in r]
    assert len(evaluations) == 2 and evaluations[1] > evaluations[0], evaluations  # greedy, held-out rows

    # The store keeps the teacher's scores of each trained trajectory: the teacher's own log-probabilities.
    with open_store(run_dir / "trajectories.h5") as store:
        consumed = list(store.trajectories("consumed"))
        marks = {m.trajectory_id: m.step for m in store.marks()}
        scores = {t.id: store.scores(t.id) for t in consumed[:8]}
    assert len(consumed) == STEPS * 16 * 4
    batch = TrainBatch.from_trajectories(consumed[:8])
    ours = TeacherScorer(teacher).score(batch)
    for i, t in enumerate(consumed[:8]):
        [(step, values)] = scores[t.id].items()
        assert step == marks[t.id] and len(values) == len(t.context())
        np.testing.assert_allclose(values, ours[i, :len(values)], atol=2e-4)
    kl = float(((batch.behaviour_logprobs - torch.from_numpy(ours)) * batch.generated).sum() / batch.num_generated)
    assert kl > 0  # the student's samples are less likely under the teacher than under the student
