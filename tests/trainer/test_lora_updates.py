"""A LoRA run's weight update (`sfhpc.weights.adapter`): the trainer sends the adapter alone, as each targeted
layer's gain, and an engine's `AdapterMerge` turns it, over the model folder's frozen weights, into exactly the
merged weights the trainer holds, in loads that keep an engine's fused projections together."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sfhpc.config.recipe import AlgorithmSpec, LoraSpec
from sfhpc.trainer.torch_trainer import TorchTrainer
from sfhpc.weights import adapter
from sfhpc.weights.errors import WeightStreamError
from sfhpc.weights.manifest import module_group
from tests.trainer.conftest import toy_batch


def test_an_engine_merges_the_adapter_into_the_weights_the_trainer_holds(tiny_model_dir: Path) -> None:
    spec = LoraSpec(rank=4, alpha=16, target_modules=("q_proj", "v_proj", "down_proj"))
    trainer = TorchTrainer(tiny_model_dir, AlgorithmSpec(learning_rate=1e-2), lora_spec=spec)
    for _ in range(2):
        trainer.train_step(toy_batch())
    update = list(trainer.update_weights())
    full = dict(trainer.named_weights())
    # Only the adapter travels: a down and an up tensor per targeted layer, far fewer bytes than the model.
    assert adapter.is_adapter(name for name, _ in update)
    targeted = {name.removesuffix(adapter.DOWN) + ".weight" for name, _ in update if name.endswith(adapter.DOWN)}
    assert targeted == {n for n in full if n.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight"))}
    update_bytes = sum(t.numel() for _, t in update)
    assert update_bytes < 0.1 * sum(t.numel() for t in full.values())
    # The engine's merge over the folder's frozen weights gives the trainer's merged weights (float32 here).
    deltas = adapter.deltas_of((name, t.clone()) for name, t in update)
    merged = dict(adapter.AdapterMerge(tiny_model_dir, torch.float32).weights(deltas))
    assert set(merged) == targeted
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, full[name], atol=1e-6, rtol=0)
        assert not torch.equal(tensor, trainer.model.get_parameter(name.replace(".weight", ".base_layer.weight")))
    # In bf16, as a bf16 engine loads them: the same merge, rounded once.
    bf16 = dict(adapter.AdapterMerge(tiny_model_dir, torch.bfloat16).weights(deltas))
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    torch.testing.assert_close(bf16["model.layers.0.self_attn.q_proj.weight"].float(),
                               full["model.layers.0.self_attn.q_proj.weight"], atol=2e-2, rtol=1e-2)


def test_loads_keep_a_blocks_projections_together(tiny_model_dir: Path) -> None:
    spec = LoraSpec(rank=2, alpha=2, target_modules="all-linear")
    trainer = TorchTrainer(tiny_model_dir, AlgorithmSpec(), lora_spec=spec)
    deltas = adapter.deltas_of(trainer.update_weights())
    loads = list(adapter.AdapterMerge(tiny_model_dir, torch.float32).loads(deltas, max_bytes=1))
    groups = [{module_group(name) for name, _ in load} for load in loads]
    assert len(loads) > 2 and all(len(g) == 1 for g in groups)  # one block a load at the smallest size
    assert len({g.pop() for g in groups}) == len(loads)  # and no block split over two loads
    assert sum(len(load) for load in loads) == len(deltas)


def test_a_stream_that_is_not_a_whole_adapter_is_refused() -> None:
    down, up = torch.zeros(2, 8), torch.zeros(8, 2)
    assert not adapter.is_adapter(["model.layers.0.self_attn.q_proj.weight"])
    assert not adapter.is_adapter([])
    with pytest.raises(WeightStreamError, match="one half of the layer 'm.q_proj'"):
        adapter.deltas_of([("m.q_proj.lora_down", down), ("m.k_proj.lora_down", down), ("m.k_proj.lora_up", up)])
    with pytest.raises(WeightStreamError, match="no adapter tensor"):
        adapter.deltas_of([("m.q_proj.weight", down)])
