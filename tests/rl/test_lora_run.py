"""A LoRA run on real vLLM engines (``model.lora``, rank 8 on every linear layer of a 4-layer built model):
each weight update sends the adapter alone (under 5% of the model's bytes), and the engines, merging it into
their frozen weights, sample with the weights the trainer holds after every update. For each trajectory sampled
by one policy version after the first two updates, the trainer restored from that version's checkpoint (the
frozen model plus its adapter) scores the sampled tokens as the engine did, within the full-model weight-sync
test's tolerance (`tests/weights/test_vllm_sync.py`: bf16 engine weights against float32). The weights travel
over a torch.distributed group that vLLM's worker joins, and the worker merges them (the default on GPUs); the
rollout rank's own merge, over MPI, is `tests/trainer/test_lora_updates.py`'s."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from sfhpc.config import load_recipe
from sfhpc.data.store import open_store
from sfhpc.plan.memory import ModelShape, lora_params
from sfhpc.rl.checkpoints import TRAINER_FILE
from sfhpc.trainer.batch import TrainBatch
from sfhpc.trainer.torch_trainer import TorchTrainer
from sfhpc.weights.hf_weights import HfWeights
from tests.conftest import ROOT, run_recipe

pytestmark = [pytest.mark.vllm, pytest.mark.mpi]

# A reply earns 1 when its length is even: about half the replies of every group, so each update moves the adapter.
EVEN_REWARD = "def reward(reply, answer):\n    return float(len(reply) % 2 == 0)\n"
LORA = f"""\
name: lora
seed: 2
model: {{build: {{layers: 4}}, lora: {{rank: 8, alpha: 16, target_modules: all-linear}}}}
algorithm: {{name: grpo, group_size: 4, learning_rate: 2.0e-2}}
pipeline: {{mode: sync}}
engine: {{weight_transport: torch}}
budgets: {{steps: 4, prompts_per_step: 4}}
training: {{checkpoint_every: 1}}
task:
  name: dataset
  options: {{path: {ROOT / 'data' / 'arith-word' / 'train.jsonl'}, prompt: question, answer: answer,
             reward: even.py:reward, max_reply_tokens: 12}}
roles:
  controller: {{place_with: trainer}}
  trainer:    {{tags: [train], nodes: 1}}
  rollout:    {{tags: [rollout], nodes: 1}}
"""


def test_vllm_samples_with_the_trainers_adapter_after_every_update(tmp_path: Path) -> None:
    (tmp_path / "even.py").write_text(EVEN_REWARD)
    run_dir, rows = run_recipe(tmp_path, LORA)
    assert [r["version"] for r in rows if "reward_mean" in r] == [1, 2, 3, 4]
    # Each update is the adapter alone, in the engines' bf16: 2 bytes an adapter parameter, under 5% of the model.
    shape = ModelShape.from_folder(run_dir / "model")
    adapter_bytes = 2 * lora_params(shape, 8, "all-linear")
    model_bytes = 2 * sum(t.numel() for t in HfWeights(run_dir / "model").values())
    assert [r["update_bytes"] for r in rows if "update_bytes" in r] == [adapter_bytes] * 4
    assert adapter_bytes <= 0.05 * model_bytes, (adapter_bytes, model_bytes)
    spec = load_recipe(tmp_path / "recipe.yaml")
    with open_store(run_dir / "trajectories.h5") as store:
        trajectories = list(store.trajectories("consumed"))
    by_version: dict[int, list] = {}
    for t in trajectories:
        versions = set(t.token_versions()[t.generated_mask()].tolist())
        if len(versions) == 1:
            by_version.setdefault(versions.pop(), []).append(t)
    assert sorted(by_version) == [0, 1, 2, 3]  # sync: step k trains what version k - 1 sampled
    gaps: list[float] = []
    for version in (2, 3):
        trainer = TorchTrainer(run_dir / "model", spec.algorithm, lora_spec=spec.model.lora)
        trainer.load_checkpoint(run_dir / "checkpoints" / f"step-{version:06d}" / TRAINER_FILE)
        assert trainer.policy_version == version
        batch = TrainBatch.from_trajectories(by_version[version])
        with torch.no_grad():
            ours = trainer.logprobs(batch)
        mask = batch.generated
        gaps += (ours[mask] - batch.behaviour_logprobs[mask]).abs().tolist()
        # The adapter is what the engine sampled with: the frozen model alone scores the tokens otherwise.
        from sfhpc.trainer import lora

        with lora.reference_mode(trainer.peft), torch.no_grad():
            frozen = trainer.logprobs(batch)
        assert float((frozen[mask] - batch.behaviour_logprobs[mask]).abs().mean()) > 3 * float(np.mean(gaps))
    assert len(gaps) > 20 and max(gaps) < 0.1 and float(np.mean(gaps)) < 0.03, gaps
