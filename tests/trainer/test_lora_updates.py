"""A LoRA run's weight update (`sfhpc.weights.adapter`): the trainer sends the adapter alone, as each targeted
layer's gain, and an engine's `AdapterMerge` turns it, over the model folder's frozen weights, into exactly the
merged weights the trainer holds, in loads that keep an engine's fused projections together, and a rollout
rank's `apply_version` loads exactly those (vLLM's worker merging over a torch group: `tests/rl/test_lora_run.py`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from sfhpc.config.recipe import AlgorithmSpec, LoraSpec
from sfhpc.engine.base import EngineStateError
from sfhpc.engine.scripted import ScriptedEngine
from sfhpc.engine.weight_sync import apply_version
from sfhpc.trainer.torch_trainer import TorchTrainer
from sfhpc.weights import adapter
from sfhpc.weights.errors import WeightStreamError
from sfhpc.weights.manifest import module_group, plan_buckets
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


class _Loads(ScriptedEngine):
    """The test engine, keeping what it is given to load (the rank's side of the weight stream is what is tested)."""

    def __init__(self) -> None:
        super().__init__(seed=0)
        self.loads: list[dict[str, torch.Tensor]] = []

    async def _load_weights(self, weights: Any) -> None:
        self.loads.append({name: t.clone() for name, t in weights})


class _Arriving:
    """Stands in for `IncomingWeights` (the broadcast itself is `tests/weights/test_broadcast.py`'s): a
    version's buckets, as a rollout rank iterates them."""

    lands_in_engine = False

    def __init__(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        self.manifest = plan_buckets(named, version, bucket_bytes=4096)
        self.version, self.num_buckets, self._named = version, self.manifest.num_buckets, dict(named)

    def __iter__(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        for index in range(self.num_buckets):
            yield [(meta.name, self._named[meta.name]) for meta in self.manifest.bucket(index)]

    def drain(self) -> None:
        return None


def test_a_rollout_rank_merges_an_adapter_version_into_its_engine(tiny_model_dir: Path) -> None:
    spec = LoraSpec(rank=4, alpha=8, target_modules="all-linear")
    trainer = TorchTrainer(tiny_model_dir, AlgorithmSpec(learning_rate=1e-2), lora_spec=spec)
    trainer.train_step(toy_batch())
    full = dict(trainer.named_weights())
    arriving = _Arriving(list(trainer.update_weights()), version=1)
    assert arriving.num_buckets > 1
    engine = _Loads()
    version = asyncio.run(apply_version(engine, arriving, adapter.AdapterMerge(tiny_model_dir, torch.float32)))  # type: ignore[arg-type]
    assert version == engine.version == 1 and not engine.paused
    loaded = {name: t for load in engine.loads for name, t in load.items()}
    assert set(loaded) == {n for n in full if n.endswith("_proj.weight")}  # every linear layer, merged
    for name, tensor in loaded.items():
        torch.testing.assert_close(tensor, full[name], atol=1e-6, rtol=0)
    # A rank with no folder to merge into refuses the version and keeps its weights and version.
    bare = _Loads()
    with pytest.raises(EngineStateError, match="no model folder to merge it into"):
        asyncio.run(apply_version(bare, _Arriving(list(trainer.update_weights()), version=1)))  # type: ignore[arg-type]
    assert bare.version == 0 and not bare.loads
