"""The RL loop on a Hugging Face folder (a tiny Qwen2 with its own BPE tokenizer and chat template, built here):
real vLLM, real torch training, real MPI. The prompts the store recorded are exactly the chat template's
tokens of the task's messages, and the replies end at the template's end-of-turn token. The run is
disaggregated, so Qwen2's q/k/v biases go over the MPI weight broadcast. A tiny Llama (untied output layer)
is served, scored and reloaded by vLLM in `tests/engine/test_hf_models.py`, as this Qwen2 is; a colocated
run's engine loading its trainer's weights is `tests/rl/test_resume_exact.py`'s."""

from __future__ import annotations

import json
import re
import string
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from sfhpc.data.store import open_store
from tests.conftest import run_sfhpc

pytestmark = [pytest.mark.vllm, pytest.mark.mpi]

RECIPE = """\
name: hf-qwen2
model: {path: PATH, name: qwen2}
pipeline: {mode: async, max_staleness: 1}
budgets: {steps: 2, prompts_per_step: 4}
algorithm: {group_size: 4}
task: {name: next-letter}
roles:
  controller: {place_with: trainer}
  trainer:    {tags: [train], nodes: 1}
  rollout:    {tags: [rollout], nodes: 1}
"""


def test_rl_loop_on_a_hugging_face_folder(tmp_path: Path) -> None:
    from sfhpc.config.recipe import TaskSpec
    from sfhpc.engine.tokenizer import load_tokenizer
    from sfhpc.model.hf_folder import build_hf_model
    from sfhpc.model.warm_start import warm_start
    from sfhpc.tasks import get_task

    folder = build_hf_model(tmp_path / "qwen2", "qwen2")
    # A short warm start on the reply format, through the model's own template: replies then end with the
    # end-of-turn token, as a real instruct model's do.
    warm_start(folder, get_task(TaskSpec("next-letter")), steps=40, learning_rate=3e-3)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.replace("PATH", str(folder)) + f"output_dir: {tmp_path / 'runs'}\n")
    done = run_sfhpc("run", str(recipe), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2]

    tokenizer = load_tokenizer(folder)
    hf = AutoTokenizer.from_pretrained(folder)  # the reference: transformers' own tokenizer of the folder
    templates = {tuple(hf.apply_chat_template([{"role": "user", "content": f"after {letter}"}],
                                              add_generation_prompt=True, tokenize=True, return_dict=False)): letter
                 for letter in string.ascii_lowercase[:-1]}
    with open_store(run_dir / "trajectories.h5") as store:
        consumed = list(store.trajectories(status="consumed"))
    assert len(consumed) == 2 * 4 * 4
    stops = set(tokenizer.chat_stop_ids)
    ended = 0
    for trajectory in consumed:
        prompt = tuple(trajectory.segments[0].tokens.tolist())
        assert prompt in templates  # the endpoint's prompt is exactly the chat template's tokens
        reply = [int(t) for s in trajectory.segments if s.generated for t in s.tokens]
        assert reply and all(0 <= t < tokenizer.vocab_size for t in reply)
        ended += reply[-1] in stops
        assert trajectory.reward in (0.0, 1.0)
    assert ended >= len(consumed) // 2, ended  # the reply ends at the end-of-turn token (3 tokens allowed)
    assert {int(v) for t in consumed for v in t.token_versions() if v >= 0} <= {0, 1}
