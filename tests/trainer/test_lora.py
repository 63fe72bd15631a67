"""LoRA on the torch backend (``model.lora``): only the adapter trains; what leaves the trainer (the merged
weights engines load, a checkpoint's adapter, the merged export and the PEFT adapter folder) scores as the
trainer does; a KL term's reference is the model with the adapter off; the memory plan counts the adapter."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from sfhpc.config.recipe import AlgorithmSpec, LoraSpec
from sfhpc.plan.memory import ModelShape, TrainerSetup, lora_params, trainer_memory
from sfhpc.trainer import lora
from sfhpc.trainer.errors import CheckpointError
from sfhpc.trainer.torch_trainer import TorchTrainer
from tests.trainer.conftest import toy_batch

SPEC = LoraSpec(rank=4, alpha=8, target_modules="all-linear")
ALGORITHM = AlgorithmSpec(learning_rate=1e-2)


def hf_model(folder: Path, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The model of `folder` with `weights` loaded (float32): as transformers and engines build it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all(name == "lm_head.weight" for name in missing), (missing, unexpected)
    return model.eval()


def test_only_the_adapter_trains_and_the_merged_weights_score_as_the_trainer(tiny_model_dir: Path) -> None:
    trainer = TorchTrainer(tiny_model_dir, ALGORITHM, lora_spec=SPEC)
    trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    frozen_before = {n: p.detach().clone() for n, p in lora.frozen_weights(trainer.model)}
    shape = ModelShape.from_folder(tiny_model_dir)
    assert sum(p.numel() for n, p in trainer.model.named_parameters() if p.requires_grad) == \
        lora_params(shape, SPEC.rank, SPEC.target_modules)
    batch = toy_batch()
    for _ in range(3):
        metrics = trainer.train_step(batch)
    assert metrics.grad_norm > 0
    # Adam holds state for the adapter alone; the frozen weights did not move, B moved away from its zeros.
    state = trainer.optimizer.state_dict()["state"]
    assert len(state) == len(trained)
    assert all(torch.equal(p, frozen_before[n]) for n, p in lora.frozen_weights(trainer.model))
    adapter = lora.adapter_state(trainer.peft)
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapter.items())
    # The merged weights, under the model's own names, score the batch as the trainer's adapter does.
    merged = dict(trainer.named_weights())
    assert set(merged) == set(frozen_before)
    engine_view = hf_model(tiny_model_dir, merged)
    ours = trainer.logprobs(batch)
    theirs = trainer.logprobs(batch, model=engine_view)
    mask = batch.generated
    torch.testing.assert_close(theirs[mask], ours[mask], atol=1e-5, rtol=0)
    frozen = trainer.logprobs(batch, model=hf_model(tiny_model_dir, frozen_before))
    assert not torch.allclose(theirs[mask], frozen[mask])


def test_a_lora_checkpoint_holds_the_adapter_and_resumes_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    batch = toy_batch()
    first = TorchTrainer(tiny_model_dir, ALGORITHM, lora_spec=SPEC)
    first.train_step(batch)
    path = first.save_checkpoint(tmp_path / "trainer.pt")
    saved = torch.load(path, weights_only=False)
    assert set(saved["model"]) == set(lora.adapter_state(first.peft)) and saved["lora"]["rank"] == 4
    assert path.stat().st_size < 0.5 * (tiny_model_dir / "model.safetensors").stat().st_size
    first.train_step(batch)
    again = TorchTrainer(tiny_model_dir, ALGORITHM, lora_spec=SPEC)
    again.load_checkpoint(path)
    again.train_step(batch)
    for (name, a), (_, b) in zip(first.named_weights(), again.named_weights(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(CheckpointError, match="model.lora"):
        TorchTrainer(tiny_model_dir, ALGORITHM).load_checkpoint(path)
    with pytest.raises(CheckpointError, match="model.lora"):
        TorchTrainer(tiny_model_dir, ALGORITHM, lora_spec=dataclasses.replace(SPEC, rank=2)).load_checkpoint(path)


def test_the_kl_reference_is_the_model_without_its_adapter(tiny_model_dir: Path) -> None:
    trainer = TorchTrainer(tiny_model_dir, dataclasses.replace(ALGORITHM, kl_coef=0.1), lora_spec=SPEC)
    assert trainer.reference is None
    batch = toy_batch()
    first = trainer.train_step(batch)
    assert first.kl == pytest.approx(0.0, abs=1e-9)  # B starts at zero: the policy is the reference
    trainer.train_step(batch)
    assert trainer.train_step(batch).kl > 1e-6
    base = TorchTrainer(tiny_model_dir, ALGORITHM)
    with lora.reference_mode(trainer.peft):
        torch.testing.assert_close(trainer.logprobs(batch), base.logprobs(batch), atol=1e-6, rtol=0)


def test_the_memory_plan_counts_the_adapter_alone() -> None:
    shape = ModelShape(layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4, head_dim=128, vocab=152064,
                       tied=False, qkv_bias=True)  # Qwen2.5-7B
    a = lora_params(shape, 16, "all-linear")
    assert a == 28 * 16 * (2 * 3584 + 2 * (3584 + 512) + 2 * 3584 + 3 * (3584 + 18944))
    assert lora_params(shape, 16, None) == 28 * 16 * ((3584 + 3584) + (3584 + 512))  # q_proj, v_proj
    setup = TrainerSetup(ranks=1, sharded=False, precision="bf16", micro_batch_tokens=8192,
                         activation_checkpointing=True, logprob_chunk_tokens=1024, reference=True)
    full = dict(trainer_memory(shape, setup).items)
    adapter = dict(trainer_memory(shape, dataclasses.replace(setup, lora_params=a)).items)
    assert adapter["frozen weights"] == 2 * shape.params and adapter["optimizer"] == 8 * a
    assert "reference model" not in adapter and full["reference model"] == 4 * shape.params
    assert sum(adapter.values()) < 0.25 * sum(full.values())
