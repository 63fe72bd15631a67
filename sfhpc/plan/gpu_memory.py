"""Whether a trainer and an engine fit one GPU, and how much of it the engine may take.

A trainer rank that also holds an engine (a colocated ``sync`` recipe, or a trainer lent to rollout in
``seamless``) shares its GPU: the trainer's state stays resident, and the engine (vLLM, in sleep mode on
such ranks) holds its weights and KV cache only while it generates. Two rules follow:

* before any job starts (`shared_gpu_problems`, from the plan): the trainer's resident state plus the
  engine's weights, the KV cache of one whole sequence and a fixed reserve must fit in the pool's GPU
  memory (the cluster map's ``gpu_memory_gib``; a pool that does not say is not checked). The trainer's
  state is full fine-tuning with Adam: float32 weights, gradients and two moments, 16 bytes per parameter,
  split over the tensor x pipeline parallel ranks; activations come on top and are not modelled;
* when the engine starts (`engine_memory_share`): vLLM's ``gpu_memory_utilization`` is a share of the whole
  GPU that must be free at its start, so on a shared GPU it is cut to what the trainer left, as measured then.

Pure: no torch, no CUDA. The numbers a user sees come from here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from sfhpc.config.recipe import Recipe
from sfhpc.plan.resolve import LaunchPlan

GIB = 1 << 30
TRAINER_BYTES_PER_PARAM = 16  # float32 weights (4), gradients (4), Adam's two moments (8)
ENGINE_RESERVE_BYTES = 1 * GIB  # vLLM's activations, sampler and allocator slack (assumed, not measured)
USABLE_SHARE = 0.95  # of a GPU's memory: the CUDA context and fragmentation take the rest (assumed)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """What memory needs of a model: its parameters and the shape of its KV cache."""

    params: int
    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: dict[str, object]) -> ModelSize:
        """From a Hugging Face ``config.json`` of a decoder (Llama, Qwen2 and their kin)."""
        def number(key: str, default: int | None = None) -> int:
            value = config.get(key, default)
            if not isinstance(value, int):
                raise ValueError(f"config.json has no integer '{key}'")
            return value

        hidden, layers, heads = number("hidden_size"), number("num_hidden_layers"), number("num_attention_heads")
        kv_heads = number("num_key_value_heads", heads)
        head_dim = config.get("head_dim") or hidden // heads
        assert isinstance(head_dim, int)
        inter, vocab = number("intermediate_size"), number("vocab_size")
        attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
        per_layer = attention + 3 * hidden * inter + 2 * hidden  # SwiGLU MLP, two norms
        embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
        return cls(params=layers * per_layer + embeddings + hidden, layers=layers, kv_heads=kv_heads,
                   head_dim=head_dim)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes  # K and V


@dataclasses.dataclass(frozen=True)
class SharedGpu:
    """One GPU that a trainer rank shares with its engine, in bytes."""

    memory: int
    trainer_state: int
    engine_weights: int
    one_sequence_kv: int

    @property
    def engine_minimum(self) -> int:
        return self.engine_weights + self.one_sequence_kv + ENGINE_RESERVE_BYTES

    @property
    def fits(self) -> bool:
        return self.trainer_state + self.engine_minimum <= self.memory * USABLE_SHARE


def shared_gpu(recipe: Recipe, size: ModelSize, gpu_memory_gib: float) -> SharedGpu:
    """The bytes a trainer rank and its engine need of one GPU of `gpu_memory_gib` under `recipe`."""
    dtype_bytes = DTYPE_BYTES.get(recipe.model.dtype, 2)
    model_parallel = recipe.training.tensor_parallel * recipe.training.pipeline_parallel
    engine_parallel = recipe.engine.tensor_parallel_size
    return SharedGpu(memory=int(gpu_memory_gib * GIB),
                     trainer_state=size.params * TRAINER_BYTES_PER_PARAM // model_parallel,
                     engine_weights=size.params * dtype_bytes // engine_parallel,
                     one_sequence_kv=size.kv_bytes_per_token(dtype_bytes) * recipe.model.max_seq_len // engine_parallel)


def model_size(recipe: Recipe) -> ModelSize | None:
    """The size of the recipe's model folder, read from its config.json; None for a model sfhpc builds (small
    by construction) or a folder whose config says too little."""
    if recipe.model.path is None:
        return None
    try:
        return ModelSize.from_config(json.loads((Path(recipe.model.path) / "config.json").read_text()))
    except (OSError, ValueError, AssertionError):
        return None  # the model folder's own check names what is wrong with it


def shared_gpu_problems(recipe: Recipe, plan: LaunchPlan, gpu_memory_gib: dict[str, float]) -> list[str]:
    """One line per pool where a trainer rank shares its GPUs with an engine that cannot fit beside it.
    `gpu_memory_gib`: each pool's GPU memory (0: unknown, not checked)."""
    size = model_size(recipe)
    if size is None:
        return []
    lending = recipe.pipeline.mode == "seamless"
    problems = []
    for pool in sorted({slot.pool for slot in plan.ranks()
                        if "trainer" in slot.roles and ("rollout" in slot.roles or lending and "rollout" in slot.tags)
                        and gpu_memory_gib.get(slot.pool, 0) > 0}):
        need = shared_gpu(recipe, size, gpu_memory_gib[pool])
        if not need.fits:
            problems.append(
                f"roles.trainer: a trainer rank shares each GPU of pool '{pool}' ({gpu_memory_gib[pool]:g} GiB) with "
                f"its engine, and they do not fit: the trainer's state {need.trainer_state / GIB:.1f} GiB (float32 "
                f"weights, gradients, Adam) + the engine's weights {need.engine_weights / GIB:.1f} GiB, one "
                f"sequence's KV cache {need.one_sequence_kv / GIB:.1f} GiB and {ENGINE_RESERVE_BYTES / GIB:g} GiB "
                f"reserve > {USABLE_SHARE:.0%} of the GPU; give rollout GPUs of its own (mode async), use more "
                "tensor or pipeline parallelism, or a pool with larger GPUs")
    return problems


def engine_memory_share(wanted: float, free_bytes: int, total_bytes: int) -> float:
    """vLLM's ``gpu_memory_utilization`` for an engine starting on a GPU another process (the trainer) uses:
    the recipe's share, cut to what is free now less the reserve (vLLM refuses to start when the share it is
    given is not free). Raises ValueError when not even the reserve is free."""
    available = (free_bytes - ENGINE_RESERVE_BYTES) / total_bytes
    if available <= 0:
        raise ValueError(f"only {free_bytes / GIB:.1f} GiB of the GPU's {total_bytes / GIB:.1f} GiB are free: no room "
                         "for an engine beside the trainer")
    return min(wanted, round(available, 3))
