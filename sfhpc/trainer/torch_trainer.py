"""The torch training backend: a Hugging Face causal LM (``AutoModelForCausalLM``) trained with GRPO or PPO-clip.

Any architecture transformers builds is trained as it is (Llama, Qwen2 with its q/k/v biases, Mistral, ...);
the weights go out under the model's own parameter names, which vLLM's loaders take as they are (it
stacks q/k/v and gate/up itself). A tied output layer is one parameter, published once as the embedding.

Master weights are float32 even when the engines run bf16: the small updates of RL would be rounded away
in bf16, so the trainer keeps full precision and the weight stream casts on the way out
(`TorchTrainer.named_weights`). Several trainer ranks run data parallel with torch DDP over gloo; every
rank receives the same global batch, computes the advantages on all of it (GRPO needs whole groups) and
trains on its share of the rows. The loss is the token mean over the *global* batch, so the result does
not depend on how rows fall on ranks.

Versions. ``policy_version`` names the weights: 0 for those in the model folder, +1 per `train_step`.
The engines tag every token with the version that sampled it; the step's staleness metric is how many
versions those tokens lag the weights being trained.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from sfhpc.config.recipe import AlgorithmSpec, LoraSpec, TrainingSpec
from sfhpc.trainer import checkpoint as ckpt
from sfhpc.trainer import host_memory, lora, micro_batches, sharding
from sfhpc.trainer.batch import TrainBatch
from sfhpc.trainer.distributed import DistSpec
from sfhpc.trainer.errors import BatchError, TrainerError
from sfhpc.trainer.losses import (
    DEFAULT_ALGORITHM,
    algorithm_advantages,
    distill_advantages,
    loss_units,
    policy_loss,
    token_logprobs,
)
from sfhpc.trainer.policy_forward import PolicyLM
from sfhpc.weights import adapter as weight_adapter

LM_PREFIX = "lm."  # PolicyLM's name for the model it wraps
# training.precision's compute dtypes; the master weights and the optimizer's state are float32 in every case.
COMPUTE_DTYPES: dict[str, torch.dtype | None] = {"float32": None, "bf16": torch.bfloat16}


def check_algorithm(algorithm: AlgorithmSpec) -> AlgorithmSpec:
    """`algorithm` if every setting is in range (a recipe's always is: the loader checks the same), else
    a TrainerError naming the first that is not. For trainers built in code."""
    problems = algorithm.problems()
    if problems:
        key, problem = problems[0]
        raise TrainerError(f"algorithm.{key}: {problem}")
    return algorithm


@dataclasses.dataclass(frozen=True)
class StepMetrics:
    """What one training step did, summed over every trainer rank (identical on all of them)."""

    step: int  # steps done, this one included
    policy_version: int  # the version of the weights this step produced
    loss: float
    mean_ratio: float  # mean over generated tokens of exp(new - behaviour), before truncation
    clip_fraction: float  # share of generated tokens whose surrogate was clipped
    truncated_fraction: float  # share whose ratio exceeded the cap
    mean_staleness: float  # mean over generated tokens of (trained version - sampling version)
    max_staleness: int
    kl: float  # mean k3 estimate to the reference (0 without one)
    grad_norm: float  # before clipping
    reward_mean: float
    tokens: int  # generated tokens in the loss
    sequences: int
    seconds: float
    entropy: float = 0.0  # mean over generated tokens of the policy's entropy at that token (nats)
    micro_batches: int = 1  # forward and backward passes per rank this step

    def as_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


def batch_advantages(batch: TrainBatch, algorithm: AlgorithmSpec) -> torch.Tensor:
    """The batch's own advantages, or the algorithm's: group-normalised (GRPO) or mean baseline (PPO).
    Shared by every training backend, so they agree on what a step optimises."""
    if batch.advantages is not None:
        return batch.advantages
    distill = algorithm.distill
    task = None if distill is not None and not distill.task_reward else algorithm_advantages(
        algorithm, batch.rewards, batch.groups, batch.generated, batch.turn_rewards, batch.reply_turns)
    if distill is None:
        assert task is not None
        return task
    if batch.teacher_logprobs is None:
        raise BatchError("algorithm.distill trains on the teacher's log-probabilities, which this batch lacks")
    return distill_advantages(task, batch.teacher_logprobs, batch.behaviour_logprobs, batch.generated, distill.weight)


class TorchTrainer:
    """Loads the policy from a Hugging Face folder and trains it one batch at a time, as the recipe's
    `AlgorithmSpec` says (loss settings and AdamW's) and its `TrainingSpec` (precision, micro-batches,
    activation checkpointing, sharding, the log-probability chunk)."""

    def __init__(self, model_dir: str | Path, algorithm: AlgorithmSpec = DEFAULT_ALGORITHM, *,
                 dist: DistSpec | None = None, initial_version: int = 0, seed: int = 0,
                 device: str = "cpu", training: TrainingSpec | None = None, lora_spec: LoraSpec | None = None) -> None:
        self.algorithm = algorithm = check_algorithm(algorithm)
        self.lora = lora_spec
        self.training = training = training or TrainingSpec()
        self.dist = dist or DistSpec(rank=0, world_size=1, backend="nccl" if device.startswith("cuda") else "gloo")
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise TrainerError(f"{self.model_dir}: no config.json; build the model first (sfhpc.model.tiny) "
                               "or point model.path at a Hugging Face folder")
        torch.manual_seed(seed)
        self.device = torch.device(device)
        if self.device.type == "cpu":
            host_memory.return_freed_memory()
        self.compute_dtype = COMPUTE_DTYPES[training.compute_precision(on_gpu=self.device.type == "cuda")]
        self.sharded = training.shards(self.dist.world_size, on_gpu=self.device.type == "cuda",
                                       lora=lora_spec is not None)
        if self.sharded and lora_spec is not None:
            raise TrainerError("model.lora trains a whole model per trainer rank: set training.sharding none or auto")
        self.peft: Any = None  # LoRA: the PEFT model around `model` (`sfhpc.trainer.lora`)
        # Sharding needs a process group even for one rank (a GPU of its own: FSDP over a group of one).
        self.dist.init_process_group(group_of_one=self.sharded)
        if self.sharded:
            self.model, self.policy = self._build_sharded(requires_grad=True)
            self._forward_model: torch.nn.Module = self.policy
        else:
            self.model, self.policy = self._build_whole()
            self._forward_model = self.policy
            if self.dist.distributed:
                # DDP broadcasts rank 0's parameters at construction, so all ranks start identical.
                self._forward_model = torch.nn.parallel.DistributedDataParallel(self.policy)
        self.reference: PolicyLM | None = None
        if algorithm.kl_coef != 0.0 and self.peft is None:  # LoRA: the adapter switched off is the reference
            self.reference = (self._build_sharded(requires_grad=False)[1] if self.sharded
                              else PolicyLM(copy.deepcopy(self.model).eval().requires_grad_(False),
                                            training.logprob_chunk_tokens))
        trained = [p for p in self.model.parameters() if p.requires_grad]
        if self.lora is not None and self.dist.rank == 0:
            print(lora.describe(self.lora, sum(p.numel() for p in trained),
                                sum(p.numel() for p in self.model.parameters())), flush=True)
        self.optimizer = torch.optim.AdamW(trained, lr=algorithm.learning_rate,
                                           betas=(algorithm.adam_beta1, algorithm.adam_beta2), eps=algorithm.adam_eps,
                                           weight_decay=algorithm.weight_decay)
        self.step = 0
        self.policy_version = initial_version

    def _build_whole(self) -> tuple[Any, PolicyLM]:
        """The whole model on this rank, float32 (the master weights), on its device."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        torch.nn.Module.to(model, self.device)  # in place; transformers types its own .to for dtypes only
        model.config.use_cache = False
        if self.training.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora is not None:
            self.peft = lora.attach(model, self.lora, self.compute_dtype)  # `model` now holds the adapter's layers
        return model.train(), PolicyLM(model, self.training.logprob_chunk_tokens)

    def _build_sharded(self, *, requires_grad: bool) -> tuple[Any, PolicyLM]:
        """This rank's shard of the model (`sfhpc.trainer.sharding`): built on the meta device, sharded over the
        trainer ranks, each rank reading its own rows of the weights files."""
        from torch.distributed.device_mesh import init_device_mesh

        model = sharding.empty_model(self.model_dir)
        if self.training.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy = PolicyLM(model, self.training.logprob_chunk_tokens)
        sharding.shard(policy, model, init_device_mesh(self.device.type, (self.dist.world_size,)), self.compute_dtype)
        sharding.materialize(policy, model, self.device)
        sharding.load_shards(model, self.model_dir)
        model.requires_grad_(requires_grad)
        return model.train(requires_grad), policy

    # -- training -----------------------------------------------------------------------------------
    def advantages(self, batch: TrainBatch) -> torch.Tensor:
        return batch_advantages(batch, self.algorithm)

    def logprobs(self, batch: TrainBatch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Per-token log-probabilities of the batch under the current weights (or `model`, any module that
        returns ``.logits``), ``[B, T]``, each at the temperature its token was sampled with."""
        batch = batch.to(self.device)
        if model is None:
            with torch.no_grad():
                return self._score(self._forward_model, batch)[0]
        with self._autocast():
            logits = model(input_ids=batch.tokens, attention_mask=batch.attention_mask, use_cache=False).logits
        return token_logprobs(logits, batch.tokens, batch.temperatures)

    def _score(self, net: torch.nn.Module, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        with self._autocast():
            return net(batch.tokens, batch.attention_mask, batch.temperatures)

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        # Sharded parameters are gathered in the compute dtype already; a whole model computes under autocast.
        enabled = self.compute_dtype is not None and not self.sharded
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype or torch.bfloat16,
                              enabled=enabled)

    def train_step(self, batch: TrainBatch, *, sharded: bool = False) -> StepMetrics:
        """One optimisation step on `batch`: forward and backward per micro-batch (gradients accumulate),
        grad clipping, AdamW.

        Every rank passes the same global batch, unless `sharded`: then each rank passes its own rows
        with advantages already computed over the global batch (``batch.advantages``).
        """
        start = time.perf_counter()
        cfg, rank, world = self.algorithm, self.dist.rank, self.dist.world_size
        if sharded and batch.advantages is None and cfg.name == "grpo" and world > 1:
            raise BatchError("a sharded GRPO batch must carry advantages computed over the global batch")
        local = batch.with_advantages(self.advantages(batch))
        if world > 1 and not sharded:
            if batch.size < world:
                raise BatchError(f"a batch of {batch.size} rows cannot feed {world} trainer ranks")
            local = local.rows(range(rank, batch.size, world))
        global_tokens, global_units = self._sum([float(local.num_generated), loss_units(cfg, local.generated)])
        # Each micro-batch's loss is a share of the global mean, so their gradients add up to the batch's.
        normaliser = max(global_units, 1.0) / world
        pieces = micro_batches.split(local, self.training.micro_batch_tokens)
        # Every rank runs as many forwards as the busiest: sharded weights are gathered in each of them.
        pieces = micro_batches.pad_to(pieces, int(self._max(float(len(pieces)))), local)

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals = torch.zeros(6, dtype=torch.float64)  # loss, ratio, clipped, truncated, kl, entropy sums
        for i, piece in enumerate(pieces):
            piece = piece.to(self.device)
            with self._gradient_sync(last=i == len(pieces) - 1):
                new_logprobs, entropy = self._score(self._forward_model, piece)
                ref_logprobs = self._reference_logprobs(piece)
                assert piece.advantages is not None  # set by with_advantages above; rows() keeps them
                out = policy_loss(new_logprobs, piece.behaviour_logprobs, piece.advantages, piece.generated, cfg,
                                  ref_logprobs=ref_logprobs, normaliser=normaliser)
                out.loss.backward()  # DDP and FSDP reduce gradients over ranks at the last micro-batch
            totals += torch.tensor([float(out.loss.detach()), out.ratio_sum, float(out.clipped), float(out.truncated),
                                    out.kl_sum, float((entropy * piece.generated).sum())], dtype=torch.float64)
        grad_norm = self._clip_gradients(cfg.max_grad_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = cfg.learning_rate_at(self.step)
        self.optimizer.step()

        staleness = (self.policy_version - local.versions).clamp(min=0) * local.generated
        max_stale = int(staleness.max()) if local.num_generated else 0
        sums = self._sum([*totals.tolist(), float(staleness.sum()), float(local.rewards.sum()), float(local.size)])
        max_stale = int(self._max(float(max_stale)))
        loss, ratio_sum, clipped, truncated, kl_sum, entropy_sum, stale_sum, reward_sum, rows = sums
        self.step += 1
        self.policy_version += 1
        n = max(global_tokens, 1.0)
        return StepMetrics(step=self.step, policy_version=self.policy_version, loss=loss / world,
                           mean_ratio=ratio_sum / n, clip_fraction=clipped / n, truncated_fraction=truncated / n,
                           mean_staleness=stale_sum / n, max_staleness=max_stale, kl=kl_sum / n,
                           grad_norm=grad_norm, reward_mean=reward_sum / max(rows, 1.0), tokens=int(global_tokens),
                           sequences=int(rows), seconds=time.perf_counter() - start, entropy=entropy_sum / n,
                           micro_batches=len(pieces))

    def _reference_logprobs(self, piece: TrainBatch) -> torch.Tensor | None:
        """The KL term's reference: the frozen starting policy's log-probabilities (None without a KL term)."""
        if self.algorithm.kl_coef == 0.0:
            return None
        with torch.no_grad():
            if self.peft is not None:
                with lora.reference_mode(self.peft):
                    return self._score(self.policy, piece)[0]
            assert self.reference is not None
            return self._score(self.reference, piece)[0]

    def _gradient_sync(self, *, last: bool) -> contextlib.AbstractContextManager[object]:
        """Gradients are reduced over the ranks once, after the last micro-batch's backward."""
        if self.sharded:
            self.policy.set_requires_gradient_sync(last)  # type: ignore[operator]  # FSDPModule's
            return contextlib.nullcontext()
        if isinstance(self._forward_model, torch.nn.parallel.DistributedDataParallel) and not last:
            return self._forward_model.no_sync()
        return contextlib.nullcontext()

    def _clip_gradients(self, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return float(sharding.full_tensor(norm))

    def _sum(self, values: list[float]) -> list[float]:
        if not self.dist.distributed:
            return values
        import torch.distributed as tdist

        t = torch.tensor(values, dtype=torch.float64, device=self._collective_device)
        tdist.all_reduce(t)
        return t.tolist()

    def _max(self, value: float) -> float:
        if not self.dist.distributed:
            return value
        import torch.distributed as tdist

        t = torch.tensor([value], dtype=torch.float64, device=self._collective_device)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return float(t)

    @property
    def _collective_device(self) -> torch.device:
        return self.device if self.dist.backend == "nccl" else torch.device("cpu")  # NCCL reduces GPU tensors only

    # -- weights out -------------------------------------------------------------------------------
    def named_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` for every parameter, in the engine's naming (vLLM stacks q/k/v itself).

        With `dtype` (e.g. ``torch.bfloat16`` for a bf16 engine) each tensor is a cast copy; without it the
        tensors are detached views of the live master weights: copy them before the next step. Sharded, each
        parameter is gathered whole as it comes: every trainer rank iterates this together
        (`weights_are_sharded`), and each holds one parameter's whole copy at a time.
        """
        if self.peft is not None:  # LoRA: the adapter merged into the frozen weights, in the model's names
            named: Iterator[tuple[str, torch.Tensor]] = lora.merged(
                lora.frozen_weights(self.model), lora.adapter_state(self.peft), self.lora.scale)  # type: ignore[union-attr]
        else:
            named = ((name, sharding.full_tensor(param.detach())) for name, param in self.model.named_parameters())
        for name, t in named:
            yield name, (t.to(dtype) if dtype is not None and t.dtype != dtype else t)

    def update_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What a weight update sends: under LoRA the adapter alone, as the gain of each layer it targets
        (`sfhpc.weights.adapter`, which each engine merges into the frozen weights it started with: a few MB
        where the model is GB), else every weight (`named_weights`)."""
        if self.peft is None:
            return self.named_weights()
        return weight_adapter.wire(lora.deltas(lora.adapter_state(self.peft), self.lora.scale))  # type: ignore[union-attr]

    @property
    def weights_are_sharded(self) -> bool:
        """Publishing and checkpoints are collective over every trainer rank (each holds a shard)."""
        return self.sharded

    # -- checkpoints -------------------------------------------------------------------------------
    def save_checkpoint(self, path: str | Path) -> Path:
        """Write model, optimizer, step, policy version and RNG state atomically (rank 0; all ranks call).
        The model is saved whole under its Hugging Face names whether or not it trains sharded."""
        path = Path(path)
        model_state, optimizer_state = self._full_state()
        if self.dist.rank == 0:
            ckpt.save_atomic({
                "model": model_state,
                "optimizer": optimizer_state,
                "step": self.step,
                "policy_version": self.policy_version,
                "rng": ckpt.rng_state(),
                "algorithm": dataclasses.asdict(self.algorithm),
                "model_config": self.model.config.to_dict(),
                "world_size": self.dist.world_size,
                "sharded": self.sharded,
                "lora": None if self.lora is None else dataclasses.asdict(self.lora),
            }, path)
        if self.dist.distributed:
            import torch.distributed as tdist

            tdist.barrier()  # nobody moves on (or reads it back) before the file is in place
        return path

    def _full_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model's and the optimizer's whole state (gathered onto the host of rank 0 when sharded)."""
        if self.peft is not None:  # LoRA: the adapter alone (the frozen weights are the model folder's)
            return lora.adapter_state(self.peft), self.optimizer.state_dict()
        if not self.sharded:
            return self.model.state_dict(), self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        # Keys of the sharded root (`PolicyLM`) are the model's own under "lm.": saved without it, as unsharded.
        model_state = {key.removeprefix(LM_PREFIX): value
                       for key, value in get_model_state_dict(self.policy, options=options).items()}
        return model_state, get_optimizer_state_dict(self.policy, self.optimizer, options=options)

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore the state `save_checkpoint` wrote; the next step is the one that would have followed."""
        state = ckpt.load(path)

        def load_weights() -> None:
            if bool(state.get("sharded", False)) != self.sharded:
                raise ValueError("it was written by a trainer that " + ("shards" if state.get("sharded") else
                                 "does not shard") + " its parameters (training.sharding)")
            if lora.spec_of(state) != self.lora:
                raise ValueError(f"it was trained with model.lora {lora.spec_of(state)}, this run has {self.lora}")
            if self.peft is not None:
                lora.load_adapter_state(self.peft, state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
                return
            if not self.sharded:
                self.model.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
                return
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            options = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.policy, {LM_PREFIX + key: value for key, value in state["model"].items()},
                                 options=options)
            set_optimizer_state_dict(self.policy, self.optimizer, state["optimizer"], options=options)

        ckpt.restore(path, self.model_dir, state, load_weights)
        self.step = int(state["step"])
        self.policy_version = int(state["policy_version"])
