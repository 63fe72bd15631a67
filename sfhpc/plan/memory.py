"""The memory plan: the bytes a trainer rank will hold, item by item, before any job runs.

One owner of "does it fit". From the model folder's ``config.json`` (`ModelShape`) and the recipe's training
settings (`TrainerSetup`) it gives each item a trainer rank of the torch backend holds at its peak (a
backward step): the float32 master weights, gradients and Adam's two moments (divided over the ranks when
sharded), the compute-dtype copies the forward uses (gathered layers when sharded, autocast's cast weights
when not), the activations of one micro-batch, one chunk of logits, a reference model for a KL term, and a
reserve for the runtime. `sfhpc plan` and `sfhpc check` print it; `sfhpc bench train` measures a rank's
peak beside it.

The activation terms are counts of the tensors autograd saves per token and decoder layer, measured on
Qwen2-architecture models with ``torch.autograd.graph.saved_tensors_hooks`` (tests/plan/test_memory.py
measures them again): without activation checkpointing about ``8 h + 4.3 i + 4.4 kv`` elements (``h`` the
hidden size, ``i`` the MLP's, ``kv`` the key/value width), held in float32 on a float32 or autocast
trainer; with it, each layer keeps its input (``h``) and the parts outside the layers add about as much
again per layer at these depths. Attention saves no ``length x length`` scores (PyTorch's fused attention
keeps one number per head and token), so activations grow with tokens, not with their square.

Pure: no torch. The figures a user sees come from here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sfhpc.config.recipe import TrainingSpec

GIB = 1 << 30
MASTER_BYTES = 4  # float32 master weights
GRAD_BYTES = 4  # float32 gradients (sharded: reduced in float32 into the shard)
ADAM_BYTES = 8  # Adam's two float32 moments
# Per token and decoder layer, the elements autograd saves for the backward (module docstring).
ACT_PER_HIDDEN, ACT_PER_MLP, ACT_PER_KV = 8.0, 4.3, 4.4
CHECKPOINTED_PER_HIDDEN = 2.5  # a checkpointed layer's input, plus what outside the layers saves, per layer
# Bytes per logit of one chunk at its peak (the backward of the chunk: compute-dtype logits, their float32
# copy, the tempered and log-softmaxed ones, and the gradients of the last three).
LOGIT_BYTES = 20
RUNTIME_RESERVE = {"gpu": int(1.0 * GIB), "cpu": int(0.5 * GIB)}  # CUDA context / the interpreter and libraries
DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "float16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What memory needs of a decoder: its widths, depth and vocabulary (a Hugging Face ``config.json``)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool = False

    @classmethod
    def from_config(cls, config: dict[str, object]) -> ModelShape:
        """From a decoder's ``config.json`` (Llama, Qwen2, Mistral and their kin); ValueError naming a missing key."""
        def number(key: str, default: int | None = None) -> int:
            value = config.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"config.json has no integer '{key}'")
            return value

        hidden, heads = number("hidden_size"), number("num_attention_heads")
        head_dim = config.get("head_dim") or hidden // heads
        if not isinstance(head_dim, int):
            raise ValueError("config.json's 'head_dim' is not an integer")
        model_type = str(config.get("model_type", ""))
        return cls(layers=number("num_hidden_layers"), hidden=hidden, intermediate=number("intermediate_size"),
                   heads=heads, kv_heads=number("num_key_value_heads", heads), head_dim=head_dim,
                   vocab=number("vocab_size"), tied=bool(config.get("tie_word_embeddings", False)),
                   qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)))

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelShape:
        return cls.from_config(json.loads((Path(folder) / "config.json").read_text()))

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = h * q * 2 + h * kv * 2 + ((q + 2 * kv) if self.qkv_bias else 0)  # q, o; k, v; biases
        return attention + 3 * h * self.intermediate + 2 * h  # SwiGLU MLP, two norms

    @property
    def outer_params(self) -> int:
        """Outside the layers: the embeddings, the output layer unless tied, the final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.outer_params

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes  # K and V

    def activation_elements(self) -> float:
        """Elements autograd saves per token and layer without checkpointing (module docstring)."""
        return (ACT_PER_HIDDEN * self.hidden + ACT_PER_MLP * self.intermediate
                + ACT_PER_KV * self.kv_heads * self.head_dim)


@dataclasses.dataclass(frozen=True)
class TrainerSetup:
    """How a trainer rank trains (the recipe's ``training`` section, resolved for its device and rank count)."""

    ranks: int  # trainer ranks (data parallel)
    sharded: bool
    precision: str  # "bf16" or "float32": the compute dtype
    micro_batch_tokens: int  # padded tokens in one forward and backward
    activation_checkpointing: bool
    logprob_chunk_tokens: int
    reference: bool = False  # a KL term keeps a frozen copy of the starting policy
    device: str = "gpu"  # "gpu" or "cpu"
    lora_params: int = 0  # LoRA: the adapter's parameters (`lora_params`); 0: every weight trains


@dataclasses.dataclass(frozen=True)
class MegatronSettings:
    """What the megatron trainer does to fit (the recipe's ``training`` section, resolved; the trainer and the
    plan both read it from here): the compute dtype, whether Adam's state and the float32 master weights are
    sharded over the data-parallel ranks (megatron's distributed optimizer), full activation recompute, and
    sequence parallelism (activations outside the tensor-parallel regions split along the sequence, with
    tensor parallel > 1; megatron's norms do it only in Transformer Engine's layers, so without it there is
    none)."""

    bf16: bool = False
    distributed_optimizer: bool = False
    recompute: bool = False
    sequence_parallel: bool = False

    @classmethod
    def from_training(cls, spec: TrainingSpec, *, tensor: int, data: int, on_gpu: bool,
                      transformer_engine: bool = True) -> MegatronSettings:
        return cls(bf16=spec.compute_precision(on_gpu=on_gpu) == "bf16",
                   distributed_optimizer=spec.shards(data, on_gpu=on_gpu),
                   recompute=spec.activation_checkpointing,
                   sequence_parallel=spec.sequence_parallel and tensor > 1 and transformer_engine)

    def describe(self, spec: TrainingSpec, *, tensor: int, data: int) -> str:
        """One line for the rank's log: what the trainer does to fit, and what it was asked for but cannot do."""
        parts = ["bf16 compute, float32 master weights" if self.bf16 else "float32",
                 f"distributed optimizer over {data} data-parallel ranks" if self.distributed_optimizer
                 else "optimizer state whole on each data-parallel rank",
                 "full recompute" if self.recompute else "no recompute"]
        if self.sequence_parallel:
            parts.append("sequence parallel")
        elif spec.sequence_parallel and tensor > 1:
            parts.append("no sequence parallelism (megatron's norms split the sequence only in Transformer "
                         "Engine's layers, and it is not installed)")
        return "megatron trainer: " + "; ".join(parts)


@dataclasses.dataclass(frozen=True)
class RankMemory:
    """The bytes one rank holds at its peak, item by item, against what it has (0: not known)."""

    role: str
    items: tuple[tuple[str, int], ...]
    capacity: int = 0

    @property
    def total(self) -> int:
        return sum(b for _, b in self.items)

    @property
    def fits(self) -> bool:
        return not self.capacity or self.total <= self.capacity

    def item(self, name: str) -> int:
        return dict(self.items).get(name, 0)

    def describe(self) -> str:
        parts = ", ".join(f"{name} {gib(b)}" for name, b in self.items if b)
        room = f" of {gib(self.capacity)}" if self.capacity else ""
        return f"{self.role}: {gib(self.total)}{room} ({parts})"


def gib(n: int | float) -> str:
    return f"{n / GIB:.2f} GiB"


def micro_batch_tokens(budget: int | None, rows: int, length: int) -> int:
    """Padded tokens in a rank's largest micro-batch of `rows` rows of `length`: whole rows within `budget`
    (at least one row; None: all of them), as `sfhpc.trainer.micro_batches` cuts them."""
    tokens = budget or rows * length
    return min(max(tokens // length * length, length), rows * length)


def equal_micro_batches(rows: int, width: int, budget: int | None, stages: int) -> int:
    """How many micro-batches of equal rows the megatron backend cuts a rank's `rows` rows of `width` padded
    tokens into: its schedules exchange activations of one fixed shape, so the count divides the rows. At
    least as many as `budget` (tokens a micro-batch may hold; None: no bound) needs, one row each at most;
    and, where the rows allow, as many as the pipeline's `stages` to keep them busy."""
    if rows < 1:
        return 1
    per = rows if not budget else max(1, budget // max(width, 1))
    busy = max(m for m in range(1, min(stages, rows) + 1) if rows % m == 0)
    least = max(-(-rows // per), busy)
    return next(m for m in range(least, rows + 1) if rows % m == 0)


# The linear layers of a decoder layer a LoRA adapter may target: (inputs, outputs) of each, by its name.
def lora_layers(shape: ModelShape) -> dict[str, tuple[int, int]]:
    h, q, kv, i = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}


LORA_DEFAULT_TARGETS = ("q_proj", "v_proj")  # PEFT's default for Llama, Qwen2 and Mistral


def lora_params(shape: ModelShape, rank: int, targets: str | tuple[str, ...] | None) -> int:
    """The parameters of a rank-`rank` adapter on `targets` (names, ``all-linear`` or None: PEFT's default):
    ``rank x (in + out)`` for each targeted linear layer of every decoder layer."""
    layers = lora_layers(shape)
    names = tuple(layers) if targets == "all-linear" else (LORA_DEFAULT_TARGETS if targets is None else
                                                            (targets,) if isinstance(targets, str) else targets)
    return shape.layers * sum(rank * sum(layers[n]) for n in names if n in layers)


def trainer_memory(shape: ModelShape, setup: TrainerSetup, capacity: int = 0) -> RankMemory:
    """The peak bytes of one torch-backend trainer rank (module docstring)."""
    p = shape.params
    shards = setup.ranks if setup.sharded else 1
    c = DTYPE_BYTES[setup.precision]
    bf16 = c == 2
    if setup.lora_params:
        return _lora_trainer_memory(shape, setup, capacity)
    items: list[tuple[str, int]] = [
        ("weights", MASTER_BYTES * p // shards),
        ("gradients", GRAD_BYTES * p // shards),
        ("optimizer", ADAM_BYTES * p // shards),
    ]
    if setup.sharded:
        # Gathered for compute: the outer parameters (root group, held through forward and backward), the layer
        # computing and the next one prefetched; their unsharded gradients before the reduce-scatter.
        gathered = c * (shape.outer_params + 2 * shape.layer_params) if shards > 1 or bf16 else 0
        unsharded_grads = (c + GRAD_BYTES) * (shape.outer_params + shape.layer_params) if shards > 1 or bf16 else 0
        items.append(("gathered weights and gradients", gathered + unsharded_grads))
    else:
        # Autocast keeps a bf16 copy of every weight it casts for the forward, until the backward is done; DDP's
        # buckets hold a second copy of the gradients.
        items.append(("bf16 weight copies", 2 * p if bf16 else 0))
        items.append(("DDP gradient buckets", GRAD_BYTES * p if setup.ranks > 1 else 0))
    items += _activations_and_logits(shape, setup)
    if setup.reference:
        items.append(("reference model", MASTER_BYTES * p // shards))
    items.append(("runtime reserve", RUNTIME_RESERVE[setup.device]))
    return RankMemory("trainer", tuple(items), capacity)


def _activations_and_logits(shape: ModelShape, setup: TrainerSetup) -> list[tuple[str, int]]:
    tokens = setup.micro_batch_tokens
    # Sharded bf16 computes in bf16 throughout; float32 and autocast keep the residual stream in float32.
    act_bytes = DTYPE_BYTES[setup.precision] if setup.sharded else 4
    full_layer = shape.activation_elements() * act_bytes * tokens
    if setup.activation_checkpointing:
        activations = shape.layers * tokens * shape.hidden * CHECKPOINTED_PER_HIDDEN * act_bytes + full_layer
    else:
        activations = shape.layers * full_layer
    return [("activations", int(activations)),
            ("logits chunk", min(setup.logprob_chunk_tokens, tokens) * shape.vocab * LOGIT_BYTES)]


def _lora_trainer_memory(shape: ModelShape, setup: TrainerSetup, capacity: int) -> RankMemory:
    """A LoRA trainer rank (`sfhpc.trainer.lora`): the frozen weights once, in the compute dtype; the adapter in
    float32 with its gradients, Adam's moments and (data parallel) DDP's buckets; no reference model (a KL term
    scores with the adapter switched off)."""
    a = setup.lora_params
    items: list[tuple[str, int]] = [
        ("frozen weights", DTYPE_BYTES[setup.precision] * shape.params),
        ("adapter", MASTER_BYTES * a),
        ("gradients", GRAD_BYTES * a),
        ("optimizer", ADAM_BYTES * a),
        ("DDP gradient buckets", GRAD_BYTES * a if setup.ranks > 1 else 0),
        *_activations_and_logits(shape, setup),
        ("runtime reserve", RUNTIME_RESERVE[setup.device]),
    ]
    return RankMemory("trainer", tuple(items), capacity)


ENGINE_RESERVE = 1 * GIB  # vLLM's activations, sampler and allocator slack (assumed, not measured)
USABLE_SHARE = 0.95  # of a GPU's memory: the CUDA context and fragmentation take the rest (assumed)


def engine_items(shape: ModelShape, *, dtype_bytes: int, tensor_parallel: int,
                 max_seq_len: int) -> list[tuple[str, int]]:
    """What an engine needs at the least, on each GPU it spans: its weights, one whole sequence's KV cache, a
    reserve (vLLM gives the KV cache whatever else its memory share leaves)."""
    return [("engine weights", shape.params * dtype_bytes // tensor_parallel),
            ("engine KV cache, one sequence", shape.kv_bytes_per_token(dtype_bytes) * max_seq_len // tensor_parallel),
            ("engine reserve", ENGINE_RESERVE)]


def teacher_memory(shape: ModelShape, *, on_gpu: bool, micro_batch_tokens: int, chunk_tokens: int,
                   capacity: int = 0) -> RankMemory:
    """The peak bytes of a distillation teacher rank (`sfhpc.trainer.teacher`): its weights (bfloat16 on a GPU,
    float32 on a CPU), one micro-batch's forward without a gradient (a layer's input, output and MLP at once)
    and one chunk of float32 logits with their log-softmax."""
    dtype = 2 if on_gpu else 4
    return RankMemory("teacher", (
        ("teacher weights", shape.params * dtype),
        ("teacher forward", micro_batch_tokens * (3 * shape.hidden + 2 * shape.intermediate) * dtype),
        ("logits chunk", min(chunk_tokens, micro_batch_tokens) * shape.vocab * 4 * 2),
        ("runtime", RUNTIME_RESERVE["gpu" if on_gpu else "cpu"]),
    ), capacity)


# Of a layer's activations, the share outside the tensor-parallel regions (norms, residuals, dropout masks),
# which tensor parallelism alone does not split and sequence parallelism does: 10 of 34 bytes per token and
# hidden unit in the published count for GPT layers (Korthikanti et al., 2022, "Reducing Activation
# Recomputation in Large Transformer Models", table 2).
UNSPLIT_ACTIVATION_SHARE = 10 / 34


def megatron_memory(shape: ModelShape, settings: MegatronSettings, *, tensor_parallel: int, pipeline_parallel: int,
                    data_parallel: int, tokens: int, reference: bool, capacity: int, in_flight: int = 1,
                    device: str = "gpu") -> RankMemory:
    """The megatron backend's rank, its model split over tensor x pipeline parallel: the weights (float32, or
    bf16 beside float32 master weights), the gradients (its DDP buffer, float32), Adam's moments (and the
    master weights, in bf16) divided over the data-parallel ranks with the distributed optimizer; a
    micro-batch of `tokens` padded tokens in a forward and backward, `in_flight` of them held at once (a
    pipeline's first stage holds up to its stages' count), each layer's activations whole or, recomputed,
    its input alone beside one layer's; and the whole logits of one micro-batch over the rank's share of the
    vocabulary."""
    split = tensor_parallel * pipeline_parallel
    p = shape.params // split
    optimizer_ranks = data_parallel if settings.distributed_optimizer else 1
    compute = 2 if settings.bf16 else 4
    items = [("weights", compute * p)]
    if settings.bf16:
        items.append(("master weights", MASTER_BYTES * p // optimizer_ranks))
    items += [("gradients", GRAD_BYTES * p), ("optimizer", ADAM_BYTES * p // optimizer_ranks)]
    layers = shape.layers // pipeline_parallel
    unsplit = 0.0 if settings.sequence_parallel or tensor_parallel == 1 else UNSPLIT_ACTIVATION_SHARE
    per_token_layer = shape.activation_elements() * compute * ((1 - unsplit) / tensor_parallel + unsplit)
    if settings.recompute:
        kept = layers * shape.hidden * compute / (tensor_parallel if settings.sequence_parallel else 1)
        activations = in_flight * tokens * kept + tokens * per_token_layer
    else:
        activations = in_flight * layers * tokens * per_token_layer
    items += [("activations", int(activations)), ("logits", tokens * shape.vocab // tensor_parallel * LOGIT_BYTES)]
    if reference:
        items.append(("reference model", compute * p))
    items.append(("runtime reserve", RUNTIME_RESERVE[device]))
    return RankMemory("trainer", tuple(items), capacity)


def advice(memory: RankMemory) -> str:
    """What to change for a plan that does not fit, by what weighs most in it."""
    if memory.item("teacher weights") > memory.total / 2:
        return "give the teacher role a pool with larger GPUs, or distil from a smaller teacher"
    if memory.item("teacher weights"):
        return "lower training.micro_batch_tokens or training.logprob_chunk_tokens (the teacher scores with them)"
    state = sum(memory.item(k) for k in ("weights", "master weights", "gradients", "optimizer", "reference model"))
    passes = sum(memory.item(k) for k in ("activations", "logits", "logits chunk"))
    if memory.item("engine weights") > state and memory.item("engine weights") > passes:
        return "give rollout GPUs of its own (mode async), or a larger engine.tensor_parallel_size"
    if memory.item("logits") and not memory.item("logits chunk") and memory.item("logits") >= state:
        return ("lower training.micro_batch_tokens (the megatron backend computes a micro-batch's logits whole), or "
                "use training.backend: torch (sharding, checkpointing, log-probabilities in chunks)")
    if state >= passes:
        return ("shard the model over more trainer ranks (training.sharding: full, more trainer nodes), use tensor "
                "or pipeline parallelism (megatron), or a pool with larger GPUs")
    return ("lower training.micro_batch_tokens, set training.activation_checkpointing: true, or lower "
            "training.logprob_chunk_tokens")
