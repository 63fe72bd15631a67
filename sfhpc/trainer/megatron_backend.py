"""The megatron-core training backend: a Llama or Qwen2 policy as a megatron GPT model, for GPU scale.

Trainer ranks form a ``tensor x pipeline x data`` grid (`ParallelSizes`, from the recipe's ``training``
section); megatron-core's ``parallel_state`` owns the process groups. The model is megatron's
``GPTModel`` configured as the folder's architecture (RMSNorm, SwiGLU, rotary positions, grouped-query
attention; Qwen2's q/k/v biases; tied or untied embeddings) and starts from the weights of the same Hugging Face
folder the torch backend and the engines load, so every backend begins at policy version 0 with the same
numbers. Only the vocabulary may differ: it is padded to a multiple of the tensor-parallel size, the
padded logits are masked out of every softmax, and the padding is stripped when the weights are
published.

One `MegatronTrainer.train_step` mirrors `TorchTrainer.train_step`: the same advantages and the same
clipped, truncated surrogate (`sfhpc.trainer.losses.policy_loss`) as a token mean over the *global*
batch; data-parallel ranks each take their share of the rows, megatron's DDP averages the gradients and
megatron's optimizer (Adam with decoupled weight decay, gradient clipping) steps. Token log-probabilities
are computed on vocabulary-sharded logits (megatron's vocab-parallel cross entropy), so no rank ever holds
the full ``[batch, seq, vocab]`` logits under tensor parallelism.

`MegatronTrainer.named_weights` streams the weights in the engine's (Hugging Face) naming, with the fused
QKV and gate/up tensors split and the tensor- and pipeline-parallel shards gathered
(`sfhpc.trainer.megatron_names` owns that mapping). Checkpoints are one atomic file per model-parallel
rank (`sfhpc.trainer.checkpoint`), written by data-parallel rank 0; the (0, 0) file is written last, so
its presence means the set is complete.

megatron-core needs CUDA: on a machine without it the trainer refuses to start (`REQUIRE_CUDA`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from sfhpc.config.recipe import AlgorithmSpec, Recipe, TrainingSpec
from sfhpc.plan.memory import MegatronSettings, equal_micro_batches
from sfhpc.trainer import checkpoint as ckpt
from sfhpc.trainer import megatron_names as names
from sfhpc.trainer.batch import TrainBatch
from sfhpc.trainer.distributed import DistSpec
from sfhpc.trainer.errors import BatchError, CheckpointError, TrainerError
from sfhpc.trainer.losses import loss_units, policy_loss, tempered
from sfhpc.trainer.torch_trainer import StepMetrics, batch_advantages, check_algorithm
from sfhpc.weights.hf_weights import HfWeights

log = logging.getLogger("sfhpc")

# megatron-core's forward, DDP and optimizer address the CUDA device directly. Tests that exercise the
# wiring on CPU machines through their own shim (tests/trainer/megatron_shim) turn this off.
REQUIRE_CUDA = True


@dataclasses.dataclass(frozen=True)
class ParallelSizes:
    """How trainer ranks split the work: ``tensor x pipeline`` model-parallel groups, ``data`` of them."""

    tensor: int = 1
    pipeline: int = 1
    data: int = 1

    def __post_init__(self) -> None:
        if min(self.tensor, self.pipeline, self.data) < 1:
            raise TrainerError(f"parallel sizes must be at least 1, found {self}")

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline * self.data

    @classmethod
    def from_training(cls, spec: TrainingSpec, world_size: int) -> ParallelSizes:
        """Data parallel = trainer ranks / (tensor x pipeline)."""
        model_parallel = spec.tensor_parallel * spec.pipeline_parallel
        if world_size % model_parallel:
            raise TrainerError(f"{world_size} trainer ranks cannot be split into tensor x pipeline = "
                               f"{spec.tensor_parallel} x {spec.pipeline_parallel} groups; use a multiple of "
                               f"{model_parallel} trainer ranks")
        return cls(tensor=spec.tensor_parallel, pipeline=spec.pipeline_parallel, data=world_size // model_parallel)


# -- the model -----------------------------------------------------------------------------------------
def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """The folder's ``config.json``, checked to describe a Llama or Qwen2 model this backend can build."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise TrainerError(f"{model_dir}: no config.json; build the model first (sfhpc.model.tiny) "
                           "or point model.path at a Hugging Face folder")
    config = json.loads(path.read_text())
    if config.get("model_type") not in ("llama", "qwen2"):
        raise TrainerError(f"{path}: model_type {config.get('model_type')!r}; the megatron backend builds Llama "
                           "and Qwen2 models only")
    if config.get("use_sliding_window"):
        raise TrainerError(f"{path}: sliding-window attention is not supported by the megatron backend")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise TrainerError(f"{path}: rope type {rope.get('rope_type')!r} is not supported by the megatron "
                           "backend (plain rotary positions only)")
    if config.get("attention_bias") or config.get("mlp_bias"):
        # Qwen2's q/k/v biases are its architecture (no flag); Llama's flags add biases to o_proj and the MLP too.
        raise TrainerError(f"{path}: Llama linear biases (attention_bias, mlp_bias) are not supported by the "
                           "megatron backend")
    return config


def _rope_theta(config: dict[str, Any]) -> float:
    return float((config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0)))


def uses_transformer_engine() -> bool:
    """Transformer Engine's fused layers where installed (GPU machines); megatron's local layers otherwise."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _params_dtype(settings: MegatronSettings) -> torch.dtype:
    return torch.bfloat16 if settings.bf16 else torch.float32


_FLOAT32 = MegatronSettings()


def transformer_config(hf: dict[str, Any], sizes: ParallelSizes, memory: MegatronSettings = _FLOAT32) -> Any:
    """megatron's ``TransformerConfig`` of the Llama model that `hf` (a ``config.json``) describes."""
    from megatron.core.transformer import TransformerConfig

    layout = names.LlamaLayout.from_hf_config(hf, tensor_parallel=sizes.tensor)
    if layout.num_kv_heads % sizes.tensor:
        raise TrainerError(f"{layout.num_kv_heads} key/value heads cannot be split over tensor_parallel "
                           f"{sizes.tensor}: use a divisor of {layout.num_kv_heads}")
    if layout.num_layers % sizes.pipeline:
        raise TrainerError(f"{layout.num_layers} layers cannot be split over pipeline_parallel {sizes.pipeline}")
    return TransformerConfig(
        num_layers=layout.num_layers, hidden_size=layout.hidden_size, ffn_hidden_size=layout.ffn_hidden_size,
        num_attention_heads=layout.num_heads, num_query_groups=layout.num_kv_heads, kv_channels=layout.head_dim,
        normalization="RMSNorm", layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, bias_activation_fusion=False,
        add_bias_linear=False, add_qkv_bias=layout.qkv_bias, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=sizes.tensor, pipeline_model_parallel_size=sizes.pipeline,
        # The model is built in float32 and loaded from the folder; in bf16 Float16Module then casts it and the
        # optimizer keeps float32 master weights beside it (RL's small updates would vanish in bf16 weights).
        params_dtype=torch.float32, bf16=memory.bf16,
        pipeline_dtype=_params_dtype(memory),  # what pipeline stages send each other
        sequence_parallel=memory.sequence_parallel,
        # Full recompute of every layer: only each layer's input is kept for the backward.
        recompute_granularity="full" if memory.recompute else None,
        recompute_method="uniform" if memory.recompute else None,
        recompute_num_layers=1 if memory.recompute else None,
        # The HF weights overwrite the random ones, but initialisation is what tags each parameter as
        # tensor-parallel (or replicated); without the tags gradient norms and clipping go wrong under TP.
        perform_initialization=True, use_cpu_initialization=not torch.cuda.is_available(),
    )


def build_gpt_model(hf: dict[str, Any], config: Any) -> Any:
    """This pipeline stage's ``GPTModel`` of the Llama architecture (weights not yet loaded)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if uses_transformer_engine():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    layout = names.LlamaLayout.from_hf_config(hf, tensor_parallel=config.tensor_model_parallel_size)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=layout.padded_vocab_size,
                    max_sequence_length=int(hf["max_position_embeddings"]),
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=layout.tied_embeddings, position_embedding_type="rope",
                    rotary_percent=1.0, rotary_base=_rope_theta(hf))


def read_hf_weights(model_dir: str | Path) -> HfWeights:
    """Every tensor of the folder's safetensors files, read when asked for, as float32 on the CPU."""
    return HfWeights(model_dir)


def _layer_offset(model: Any) -> int:
    # megatron numbers a stage's layers from 1 globally; the parameter names count from 0 locally.
    layers = model.decoder.layers
    return int(layers[0].layer_number) - 1 if len(layers) else 0


def load_hf_weights(model: Any, hf_weights: Mapping[str, torch.Tensor], layout: names.LlamaLayout) -> None:
    """Copy this rank's shard of every parameter of `model` (one pipeline stage) from HF-named weights, made one
    megatron tensor at a time (only this stage's are read)."""
    from megatron.core import parallel_state as ps

    make = names.megatron_tensors(hf_weights, layout, fused_norms=uses_transformer_engine())
    rank, size, offset = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(), \
        _layer_offset(model)
    with torch.no_grad():
        for local, param in model.named_parameters():
            name = names.with_layer_offset(local, offset)
            if name not in make:
                raise TrainerError(f"the megatron model has a parameter {name!r} the Llama mapping does not fill")
            part = names.shard(name, make[name](), rank, size)
            if tuple(part.shape) != tuple(param.shape):
                raise TrainerError(f"{name}: the HF weights give shape {tuple(part.shape)}, the megatron model "
                                   f"expects {tuple(param.shape)}")
            param.copy_(part)


def vocab_parallel_logprobs(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int,
                            temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """`sfhpc.trainer.losses.token_logprobs` on this rank's vocabulary shard of the logits, ``[B, T]``
    (`temperature`: one number, or the ``[B, T]`` temperature each token was sampled at).

    `logits` is ``[B, T, padded_vocab / tp]``. Padded vocabulary entries are masked to the lowest float so
    they take no probability; position 0 gets 0 as in `token_logprobs`.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = tempered(logits[:, :-1].float(), temperature)
    width = logits.shape[-1]
    first = ps.get_tensor_model_parallel_rank() * width
    padded = torch.arange(first, first + width, device=logits.device) >= vocab_size
    if bool(padded.any()):
        logits = logits.masked_fill(padded, torch.finfo(logits.dtype).min)
    # megatron's cross entropy wants [seq, batch]; it returns -log p(target).
    nll = vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), tokens[:, 1:].t().contiguous())
    return torch.nn.functional.pad(-nll.t(), (1, 0))


_DEFAULT_ALGORITHM = AlgorithmSpec()
_DEFAULT_TRAINING = TrainingSpec(backend="megatron")


# -- the trainer -----------------------------------------------------------------------------------------
class MegatronTrainer:
    """Loads the policy from a Hugging Face folder into megatron-core and trains it one batch at a time.

    Every trainer rank constructs one with the same arguments; `dist` says where it sits among them.
    """

    def __init__(self, model_dir: str | Path, algorithm: AlgorithmSpec = _DEFAULT_ALGORITHM, *,
                 training: TrainingSpec = _DEFAULT_TRAINING, dist: DistSpec | None = None,
                 initial_version: int = 0, seed: int = 0) -> None:
        if REQUIRE_CUDA and not torch.cuda.is_available():
            raise TrainerError("training.backend 'megatron' needs CUDA GPUs; use backend 'torch' on CPU machines")
        from megatron.core import tensor_parallel
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.algorithm = config = check_algorithm(algorithm)
        self.dist = dist or DistSpec.single()
        self.model_dir = Path(model_dir)
        self.sizes = ParallelSizes.from_training(training, self.dist.world_size)
        self.micro_batch_tokens = training.micro_batch_tokens
        if config.kl_coef != 0.0 and self.sizes.pipeline > 1:
            raise TrainerError("a KL penalty (algorithm.kl_coef) needs pipeline_parallel 1 in the megatron backend")
        hf = read_hf_config(self.model_dir)
        self.layout = names.LlamaLayout.from_hf_config(hf, tensor_parallel=self.sizes.tensor)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        _init_parallel_state(self.dist, self.sizes, self.device)
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)

        self.memory = memory = MegatronSettings.from_training(
            training, tensor=self.sizes.tensor, data=self.sizes.data, on_gpu=self.device.type == "cuda",
            transformer_engine=uses_transformer_engine())
        log.info(memory.describe(training, tensor=self.sizes.tensor, data=self.sizes.data))
        self.model_config = transformer_config(hf, self.sizes, memory)
        hf_weights = read_hf_weights(self.model_dir)
        module = build_gpt_model(hf, self.model_config)
        load_hf_weights(module, hf_weights, self.layout)
        self.module = module.to(self.device)
        masters = {n: p.detach().clone() for n, p in self.module.named_parameters()} if memory.bf16 else {}
        self.reference = None
        if config.kl_coef != 0.0:
            reference = build_gpt_model(hf, self.model_config)
            load_hf_weights(reference, hf_weights, self.layout)
            self.reference = _in_precision(reference.to(self.device), self.model_config).eval().requires_grad_(False)
        del hf_weights

        # megatron's DDP keeps gradients in contiguous fp32 buffers and averages them over data-parallel
        # ranks when the step's gradients are final (finalize_model_grads, called by the schedule); with the
        # distributed optimizer it reduce-scatters them instead, each rank keeping its shard.
        self.model = DistributedDataParallel(
            config=self.model_config,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                     use_distributed_optimizer=memory.distributed_optimizer),
            module=_in_precision(self.module, self.model_config))
        self.model_config.finalize_model_grads_func = finalize_model_grads
        self.model_config.no_sync_func = self.model.no_sync
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=config.learning_rate, weight_decay=config.weight_decay,
                            adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2,
                            adam_eps=config.adam_eps, clip_grad=config.max_grad_norm, bf16=memory.bf16, fp16=False,
                            params_dtype=_params_dtype(memory),
                            use_distributed_optimizer=memory.distributed_optimizer),
            [self.model])
        if masters:
            self._set_master_weights(masters)
        self.step = 0
        self.policy_version = initial_version

    def _set_master_weights(self, masters: dict[str, torch.Tensor]) -> None:
        """Seed the optimizer's float32 master weights with the folder's own values (megatron would copy them
        from the model's bf16 cast, rounding each weight before the first step)."""
        if self.memory.distributed_optimizer:
            self.optimizer.reload_model_params(state_dict=masters)
            return
        with torch.no_grad():
            for name, param in self.module.named_parameters():
                param.main_param.copy_(masters[name])

    # -- where this rank sits --------------------------------------------------------------------------
    @property
    def tp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_rank()

    @property
    def pp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_rank()

    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank()

    # -- training ---------------------------------------------------------------------------------------
    def advantages(self, batch: TrainBatch) -> torch.Tensor:
        return batch_advantages(batch, self.algorithm)

    def logits(self, tokens: torch.Tensor, model: Any = None) -> torch.Tensor:
        """This tensor-parallel rank's vocabulary shard of the logits, ``[B, T, padded_vocab / tp]``
        (one pipeline stage only: with pipeline parallelism use `train_step`)."""
        if self.sizes.pipeline > 1:
            raise TrainerError("logits() runs the whole model on one rank; it needs pipeline_parallel 1")
        net = model if model is not None else self.model
        tokens = tokens.to(self.device)
        positions = torch.arange(tokens.shape[1], device=self.device).unsqueeze(0).expand_as(tokens)
        # Causal attention without a padding mask: rows are right-padded, so a real token never sees padding.
        return net(input_ids=tokens, position_ids=positions, attention_mask=None)

    def logprobs(self, batch: TrainBatch, model: Any = None) -> torch.Tensor:
        """Per-token log-probabilities of the batch under the current weights, ``[B, T]`` (pipeline 1), each
        at the temperature its token was sampled with."""
        return vocab_parallel_logprobs(self.logits(batch.tokens, model), batch.tokens.to(self.device),
                                       self.layout.vocab_size, batch.temperatures)

    def train_step(self, batch: TrainBatch, *, sharded: bool = False) -> StepMetrics:
        """One optimisation step on `batch`: forward, loss, backward, gradient clipping, Adam.

        Every rank passes the same global batch, unless `sharded`: then the ranks of one data-parallel
        replica pass the same rows of their own, with advantages already computed over the global batch.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        start = time.perf_counter()
        cfg, dp = self.algorithm, self.sizes.data
        if sharded and batch.advantages is None and cfg.name == "grpo" and dp > 1:
            raise BatchError("a sharded GRPO batch must carry advantages computed over the global batch")
        local = batch.with_advantages(self.advantages(batch))
        if dp > 1 and not sharded:
            if batch.size < dp:
                raise BatchError(f"a batch of {batch.size} rows cannot feed {dp} data-parallel replicas")
            local = local.rows(range(self.dp_rank, batch.size, dp))
        global_tokens, global_units = (self._dp_sum([float(local.num_generated), loss_units(cfg, local.generated)])
                                       if sharded else [float(batch.num_generated), loss_units(cfg, batch.generated)])
        normaliser = max(global_units, 1.0) / dp  # DDP averages over replicas: together, the global mean

        # Equal microbatches (pipeline stages exchange fixed [seq, micro_batch, hidden] activations), each within
        # training.micro_batch_tokens, and as many as the stages where the rows allow, to keep them all busy.
        num_micro = equal_micro_batches(local.size, int(local.tokens.shape[1]), self.micro_batch_tokens,
                                        self.sizes.pipeline)
        microbatches = [local.rows(idx.tolist()) for idx in torch.arange(local.size).chunk(num_micro)]
        stats: list[torch.Tensor] = []

        def loss_func(mb: TrainBatch, ref: torch.Tensor | None, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
            assert mb.advantages is not None  # local's advantages follow its rows into each microbatch
            new = vocab_parallel_logprobs(logits, mb.tokens.to(self.device), self.layout.vocab_size,
                                          mb.temperatures)
            out = policy_loss(new, mb.behaviour_logprobs.to(self.device), mb.advantages.to(self.device),
                              mb.generated.to(self.device), cfg, ref_logprobs=ref, normaliser=normaliser)
            stats.append(torch.tensor([float(out.loss.detach()), out.ratio_sum, float(out.clipped),
                                       float(out.truncated), out.kl_sum], dtype=torch.float64))
            # The schedule divides each microbatch's loss by their number; ours is already a share of the
            # global mean, so undo that.
            return out.loss * num_micro, {}

        def forward_step(data: Iterator[TrainBatch], model: Any) -> tuple[torch.Tensor, Any]:
            mb = next(data)
            ref = None
            if self.reference is not None:
                with torch.no_grad():
                    ref = self.logprobs(mb, self.reference)
            tokens = mb.tokens.to(self.device)
            positions = torch.arange(tokens.shape[1], device=self.device).unsqueeze(0).expand_as(tokens)
            output = model(input_ids=tokens, position_ids=positions, attention_mask=None)
            return output, lambda logits: loss_func(mb, ref, logits)

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(microbatches), model=[self.model],
            num_microbatches=num_micro, seq_length=int(local.tokens.shape[1]),
            micro_batch_size=microbatches[0].size, forward_only=False)
        for group in self.optimizer.param_groups:
            group["lr"] = self.algorithm.learning_rate_at(self.step)
        updated, grad_norm, _ = self.optimizer.step()
        if not updated:
            raise TrainerError("the optimizer skipped the step (non-finite gradients)")

        # Loss statistics exist on the last pipeline stage; the batch statistics on every rank.
        loss_stats = torch.stack(stats).sum(0) if stats else torch.zeros(5, dtype=torch.float64)
        loss_stats = self._pp_sum(loss_stats)
        staleness = (self.policy_version - local.versions).clamp(min=0) * local.generated
        max_stale = int(staleness.max()) if local.num_generated else 0
        loss, ratio_sum, clipped, truncated, kl_sum, stale_sum, reward_sum, rows = self._dp_sum(
            [*loss_stats.tolist(), float(staleness.sum()), float(local.rewards.sum()), float(local.size)])
        max_stale = int(self._dp_max(float(max_stale)))
        self.step += 1
        self.policy_version += 1
        n = max(global_tokens, 1.0)
        return StepMetrics(step=self.step, policy_version=self.policy_version, loss=loss / dp,
                           mean_ratio=ratio_sum / n, clip_fraction=clipped / n, truncated_fraction=truncated / n,
                           mean_staleness=stale_sum / n, max_staleness=max_stale, kl=kl_sum / n,
                           grad_norm=float(grad_norm), reward_mean=reward_sum / max(rows, 1.0),
                           tokens=int(global_tokens), sequences=int(rows), seconds=time.perf_counter() - start,
                           micro_batches=num_micro)

    def _dp_sum(self, values: list[float]) -> list[float]:
        from megatron.core import parallel_state as ps

        if self.sizes.data == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, group=ps.get_data_parallel_group())
        return t.cpu().tolist()

    def _dp_max(self, value: float) -> float:
        from megatron.core import parallel_state as ps

        if self.sizes.data == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=ps.get_data_parallel_group())
        return float(t.cpu())

    def _pp_sum(self, t: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        if self.sizes.pipeline == 1:
            return t
        t = t.to(self.device)
        torch.distributed.all_reduce(t, group=ps.get_pipeline_model_parallel_group())
        return t.cpu()

    # -- weights out ------------------------------------------------------------------------------------
    def named_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` for every parameter of the whole model, in the engine's naming, on every rank.

        Tensor-parallel shards are gathered and pipeline stages broadcast theirs, so all ranks must iterate
        together. With `dtype` each tensor is a cast copy; without it, with one model-parallel rank, the
        tensors are views of the live float32 master weights: copy them before the next step.
        """
        for name, full in self._full_megatron_weights():
            for hf_name, t in names.megatron_to_hf(name, full, self.layout):
                t = t.detach()
                yield hf_name, (t.to(dtype) if dtype is not None and t.dtype != dtype else t)

    update_weights = named_weights  # a weight update sends every weight

    def _full_megatron_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(global megatron name, unsharded tensor) for every parameter of every pipeline stage."""
        from megatron.core import parallel_state as ps

        offset = _layer_offset(self.module)
        local = [(names.with_layer_offset(n, offset), p) for n, p in self.module.named_parameters()]
        tp, pp = self.sizes.tensor, self.sizes.pipeline
        for stage in range(pp):
            # Every rank learns the stage's names and shapes, then receives its tensors in that order.
            listing = [[(n, tuple(p.shape)) for n, p in local] if stage == self.pp_rank else None]
            if pp > 1:
                torch.distributed.broadcast_object_list(listing, group_src=stage,
                                                        group=ps.get_pipeline_model_parallel_group())
            params = dict(local) if stage == self.pp_rank else {}
            assert listing[0] is not None  # the stage's own listing, or the one it broadcast
            for name, shape in listing[0]:
                if stage == self.pp_rank:
                    part = params[name].detach()
                    if tp > 1 and names.shard_dim(name) is not None:
                        parts = [torch.empty_like(part) for _ in range(tp)]
                        torch.distributed.all_gather(parts, part.contiguous(),
                                                     group=ps.get_tensor_model_parallel_group())
                        full = names.unshard(name, parts)
                    else:
                        full = part
                else:
                    full_shape = list(shape)
                    dim = names.shard_dim(name)
                    if dim is not None:
                        full_shape[dim] *= tp
                    full = torch.empty(full_shape, dtype=_params_dtype(self.memory), device=self.device)
                if pp > 1:
                    full = full.contiguous()
                    torch.distributed.broadcast(full, group_src=stage, group=ps.get_pipeline_model_parallel_group())
                yield name, full

    # -- checkpoints ------------------------------------------------------------------------------------
    def checkpoint_part(self, path: str | Path) -> Path:
        """The file this model-parallel rank's state goes to: `path` itself for (tp 0, pp 0)."""
        path = Path(path)
        if (self.tp_rank, self.pp_rank) == (0, 0):
            return path
        return path.with_name(f"{path.name}.tp{self.tp_rank}-pp{self.pp_rank}")

    def save_checkpoint(self, path: str | Path) -> Path:
        """Write model shard, optimizer, step, version and RNG state atomically (every rank calls)."""
        path = Path(path)
        state = {
            "backend": "megatron",
            "model": {k: v for k, v in self.module.state_dict().items() if not k.endswith("_extra_state")},
            "optimizer": self.optimizer.state_dict(),
            "precision": "bf16" if self.memory.bf16 else "float32",
            "distributed_optimizer": self.memory.distributed_optimizer,
            "step": self.step,
            "policy_version": self.policy_version,
            "rng": ckpt.rng_state(),
            "algorithm": dataclasses.asdict(self.algorithm),
            "parallel": dataclasses.asdict(self.sizes),
        }
        if self.memory.distributed_optimizer:
            # Each data-parallel rank holds its own shard of Adam's state and the master weights: one file each.
            ckpt.save_atomic({"optimizer_shards": self._optimizer_shards()}, self._optimizer_shard_path(path))
        writer = self.dp_rank == 0
        if writer and (self.tp_rank, self.pp_rank) != (0, 0):
            ckpt.save_atomic(state, self.checkpoint_part(path))
        self._barrier()  # every other part is in place before the (0, 0) file marks the set complete
        if writer and (self.tp_rank, self.pp_rank) == (0, 0):
            ckpt.save_atomic(state, path)
        self._barrier()  # nobody moves on (or reads it back) before the set is complete
        return path

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore the state `save_checkpoint` wrote; the next step is the one that would have followed."""
        state = ckpt.load(self.checkpoint_part(path))
        if state.get("backend") != "megatron":
            raise CheckpointError(f"{path}: written by the {state.get('backend', 'torch')} backend, not megatron")
        written = ("bf16" if state.get("precision") == "bf16" else "float32", bool(state.get("distributed_optimizer")))
        if written != (("bf16" if self.memory.bf16 else "float32"), self.memory.distributed_optimizer):
            raise CheckpointError(f"{path}: written in {written[0]} with the distributed optimizer "
                                  f"{'on' if written[1] else 'off'}; this run trains in "
                                  f"{'bf16' if self.memory.bf16 else 'float32'} with it "
                                  f"{'on' if self.memory.distributed_optimizer else 'off'}: resume with the same "
                                  "training.precision and training.sharding")
        if state.get("parallel") != dataclasses.asdict(self.sizes):
            raise CheckpointError(f"{path}: written with parallel sizes {state.get('parallel')}, this run has "
                                  f"{dataclasses.asdict(self.sizes)}; resume with the same layout")
        def load_weights() -> None:
            self.module.load_state_dict(state["model"], strict=False)
            missing = {k for k, _ in self.module.named_parameters()} - set(state["model"])
            if missing:
                raise KeyError(f"missing {sorted(missing)[0]}")
            self.optimizer.load_state_dict(state["optimizer"])
            if self.memory.distributed_optimizer:
                self._load_optimizer_shards(ckpt.load(self._optimizer_shard_path(path))["optimizer_shards"])

        ckpt.restore(path, self.model_dir, state, load_weights)
        self.step = int(state["step"])
        self.policy_version = int(state["policy_version"])

    def _optimizer_shard_path(self, path: str | Path) -> Path:
        part = self.checkpoint_part(path)
        return part.with_name(f"{part.name}.dp{self.dp_rank}")

    def _optimizer_shards(self) -> list[dict[str, dict[str, Any]]]:
        """This rank's shard of the distributed optimizer, per parameter name: its float32 master slice and
        Adam's state for it. (megatron's own gathered format, ``get_parameter_state_dp_zero``, leaves out the
        per-parameter ``step`` of torch's Adam, which megatron uses where neither Transformer Engine nor Apex is
        installed, and cannot be loaded back then; this reads and writes what the optimizer holds.)"""
        named = list(self.module.named_parameters())
        shards = []
        for optimizer in _inner_optimizers(self.optimizer):
            owned = optimizer.model_param_group_index_map
            shards.append({name: {k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                                  for k, v in optimizer._get_main_param_and_optimizer_states(param).items()}
                           for name, param in named if param in owned})
        return shards

    def _load_optimizer_shards(self, shards: list[dict[str, dict[str, Any]]]) -> None:
        named = list(self.module.named_parameters())
        # No autograd: in float32 the master slices are views of the model's own (leaf) parameters.
        with torch.no_grad():
            for optimizer, shard in zip(_inner_optimizers(self.optimizer), shards, strict=True):
                owned = optimizer.model_param_group_index_map
                for name, param in named:
                    if param not in owned:
                        continue
                    saved = shard[name]
                    main = optimizer._get_main_param_and_optimizer_states(param)["param"]
                    main.copy_(saved["param"])
                    # Tensors of their own: after megatron's load_state_dict every parameter's ``step`` is one
                    # shared tensor, which Adam would then advance once per parameter.
                    optimizer.optimizer.state[main].update(
                        {k: v.clone().to(main.device) if torch.is_tensor(v) else v
                         for k, v in saved.items() if k != "param"})

    def _barrier(self) -> None:
        if self.sizes.world_size > 1:
            torch.distributed.barrier()

    @classmethod
    def from_recipe(cls, recipe: Recipe, model_dir: str | Path, *, dist: DistSpec | None = None) -> MegatronTrainer:
        """The trainer a recipe describes: its algorithm section as it is, and its training section's
        parallelism."""
        if recipe.training.backend != "megatron":
            raise TrainerError(f"{recipe.source or recipe.name}: training.backend is {recipe.training.backend!r}, "
                               "not 'megatron'")
        return cls(model_dir, recipe.algorithm, training=recipe.training, dist=dist, seed=recipe.seed)


def _in_precision(module: Any, config: Any) -> Any:
    """`module` computing in the config's precision: in bf16, wrapped in megatron's ``Float16Module`` (which
    casts its parameters to bf16, its inputs on the first stage, and its logits back to float32 on the last)."""
    if not config.bf16:
        return module
    from megatron.core.transformer.module import Float16Module

    return Float16Module(config, module)


def _inner_optimizers(optimizer: Any) -> list[Any]:
    """The megatron optimizers `optimizer` holds: itself, or the parts of a ``ChainedOptimizer``."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _init_parallel_state(dist: DistSpec, sizes: ParallelSizes, device: torch.device) -> None:
    """torch.distributed and megatron's process groups, once per process (reused when they match)."""
    import torch.distributed as tdist
    from megatron.core import parallel_state as ps

    if sizes.world_size != dist.world_size:
        raise TrainerError(f"parallel sizes {sizes} need {sizes.world_size} trainer ranks, found {dist.world_size}")
    if device.type == "cuda" and dist.backend == "gloo":
        dist = dataclasses.replace(dist, backend="nccl")  # megatron's collectives run on the GPU
    if not tdist.is_initialized():
        if dist.distributed:
            dist.init_process_group()
        else:
            # megatron's groups need torch.distributed even for one rank: an in-process store suffices.
            tdist.init_process_group(backend=dist.backend, store=tdist.HashStore(), rank=0, world_size=1)
    if ps.model_parallel_is_initialized():
        current = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if current != (sizes.tensor, sizes.pipeline):
            raise TrainerError(f"this process already runs megatron with tensor x pipeline = {current}, "
                               f"not {(sizes.tensor, sizes.pipeline)}")
        return
    ps.initialize_model_parallel(tensor_model_parallel_size=sizes.tensor,
                                 pipeline_model_parallel_size=sizes.pipeline)
