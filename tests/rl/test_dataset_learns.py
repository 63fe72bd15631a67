"""The dataset task learns in a real RL run: arith-word problems (written by the shipped generate.py, on a
subset of its sums so that a test can afford it), real vLLM rollouts, real torch training, the numeric
verifier on every reply, the worked warm start. The run is seeded and `sync` on one rank, so it computes
the same rewards every time it runs here (`test_resume_exact` asserts that of a seeded sync run): the rise
asserted is this run's, not a lucky draw of an asynchronous one."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT, run_sfhpc

pytestmark = [pytest.mark.vllm]

FIRST_NUMBERS = ("2", "7")  # 2 + 1, 2 - 1, 7 + 1, 7 - 1: four results, so chance is 1 in 4
STEPS = 30

RECIPE = f"""\
name: arith-learn
seed: 5
model: {{warm_start_steps: 60}}
algorithm: {{name: grpo, group_size: 8, learning_rate: 1.0e-3, kl_coef: 0.05}}
pipeline: {{mode: sync}}
budgets: {{steps: {STEPS}, prompts_per_step: 16}}
task:
  name: dataset
  options: {{path: train.jsonl, prompt: question, answer: answer, reward: numeric, max_reply_tokens: 10,
             warm_start: worked}}
roles:
  controller: {{place_with: trainer}}
  trainer:    {{tags: [train, rollout], nodes: 1}}
  rollout:    {{colocate_with: trainer}}
"""


def test_reward_on_word_problems_rises_on_a_seeded_run(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "data" / "arith-word" / "generate.py"), "--out", str(tmp_path),
                    "--train", "400", "--test", "0", "--first", *FIRST_NUMBERS], check=True)
    recipe = tmp_path / "arith.yaml"
    recipe.write_text(RECIPE + f"output_dir: {tmp_path / 'runs'}\n")
    done = run_sfhpc("run", str(recipe), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    rewards = [json.loads(line)["reward_mean"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rewards) == STEPS
    # Measured: 0.23 -> 0.94 (steps 1 and 30), 0.15 over the first 5 steps, 0.89 over the last 5. Without
    # the KL term to the warm-started model, the tiny model learned to end replies on any number that
    # might be right ("2 - 1 - 1 - 1"), which the numeric reward (the reply's last number) pays for.
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    assert first < 0.4, rewards  # the warm start taught the format, not the results (chance: 0.25)
    assert last > max(0.6, first + 0.4), rewards
