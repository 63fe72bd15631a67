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

import copy
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from sfhpc.config.recipe import AlgorithmSpec
from sfhpc.trainer import checkpoint as ckpt
from sfhpc.trainer.batch import TrainBatch
from sfhpc.trainer.distributed import DistSpec
from sfhpc.trainer.errors import BatchError, TrainerError
from sfhpc.trainer.losses import DEFAULT_ALGORITHM, algorithm_advantages, loss_units, policy_loss, token_logprobs


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

    def as_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


def batch_advantages(batch: TrainBatch, algorithm: AlgorithmSpec) -> torch.Tensor:
    """The batch's own advantages, or the algorithm's: group-normalised (GRPO) or mean baseline (PPO).
    Shared by every training backend, so they agree on what a step optimises."""
    if batch.advantages is not None:
        return batch.advantages
    return algorithm_advantages(algorithm, batch.rewards, batch.groups, batch.generated, batch.turn_rewards)


class TorchTrainer:
    """Loads the policy from a Hugging Face folder and trains it one batch at a time, as the recipe's
    `AlgorithmSpec` says (loss settings and AdamW's)."""

    def __init__(self, model_dir: str | Path, algorithm: AlgorithmSpec = DEFAULT_ALGORITHM, *,
                 dist: DistSpec | None = None, initial_version: int = 0, seed: int = 0,
                 device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        self.algorithm = algorithm = check_algorithm(algorithm)
        self.dist = dist or DistSpec.single()
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise TrainerError(f"{self.model_dir}: no config.json; build the model first (sfhpc.model.tiny) "
                               "or point model.path at a Hugging Face folder")
        torch.manual_seed(seed)
        # float32 master weights wherever it trains; on CUDA the forward and backward run under bf16 autocast.
        self.device = torch.device(device)
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        torch.nn.Module.to(model, self.device)  # in place; transformers types its own .to for dtypes only
        model.config.use_cache = False
        self.model = model.train()
        self.reference = None
        if algorithm.kl_coef != 0.0:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.dist.init_process_group()
        self._forward_model: torch.nn.Module = self.model
        if self.dist.distributed:
            # DDP broadcasts rank 0's parameters at construction, so all ranks start identical.
            self._forward_model = torch.nn.parallel.DistributedDataParallel(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=algorithm.learning_rate,
                                           betas=(algorithm.adam_beta1, algorithm.adam_beta2), eps=algorithm.adam_eps,
                                           weight_decay=algorithm.weight_decay)
        self.step = 0
        self.policy_version = initial_version

    # -- training -----------------------------------------------------------------------------------
    def advantages(self, batch: TrainBatch) -> torch.Tensor:
        return batch_advantages(batch, self.algorithm)

    def logprobs(self, batch: TrainBatch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Per-token log-probabilities of the batch under the current weights (or `model`), ``[B, T]``, each
        at the temperature its token was sampled with (``batch.temperatures``)."""
        net = model if model is not None else self._forward_model
        batch = batch.to(self.device)
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            logits = net(input_ids=batch.tokens, attention_mask=batch.attention_mask, use_cache=False).logits
        return token_logprobs(logits, batch.tokens, batch.temperatures)

    def train_step(self, batch: TrainBatch, *, sharded: bool = False) -> StepMetrics:
        """One optimisation step on `batch`: forward, loss, backward, grad clipping, AdamW.

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
        local = local.to(self.device)  # this rank's rows only

        self.model.train()
        new_logprobs = self.logprobs(local)
        ref_logprobs = None
        if self.reference is not None:
            with torch.no_grad():
                ref_logprobs = self.logprobs(local, self.reference)
        global_tokens, global_units = self._sum([float(local.num_generated), loss_units(cfg, local.generated)])
        assert local.advantages is not None  # set by with_advantages above; rows() keeps them
        out = policy_loss(new_logprobs, local.behaviour_logprobs, local.advantages, local.generated, cfg,
                          ref_logprobs=ref_logprobs, normaliser=max(global_units, 1.0) / world)
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()  # DDP averages gradients over ranks here
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm))
        for group in self.optimizer.param_groups:
            group["lr"] = cfg.learning_rate_at(self.step)
        self.optimizer.step()

        staleness = (self.policy_version - local.versions).clamp(min=0) * local.generated
        max_stale = int(staleness.max()) if local.num_generated else 0
        sums = self._sum([float(out.loss.detach()), out.ratio_sum, float(out.clipped), float(out.truncated),
                          out.kl_sum, float(staleness.sum()), float(local.rewards.sum()), float(local.size)])
        max_stale = int(self._max(float(max_stale)))
        loss, ratio_sum, clipped, truncated, kl_sum, stale_sum, reward_sum, rows = sums
        self.step += 1
        self.policy_version += 1
        n = max(global_tokens, 1.0)
        return StepMetrics(step=self.step, policy_version=self.policy_version, loss=loss / world,
                           mean_ratio=ratio_sum / n, clip_fraction=clipped / n, truncated_fraction=truncated / n,
                           mean_staleness=stale_sum / n, max_staleness=max_stale, kl=kl_sum / n,
                           grad_norm=grad_norm, reward_mean=reward_sum / max(rows, 1.0), tokens=int(global_tokens),
                           sequences=int(rows), seconds=time.perf_counter() - start)

    def _sum(self, values: list[float]) -> list[float]:
        if not self.dist.distributed:
            return values
        import torch.distributed as tdist

        t = torch.tensor(values, dtype=torch.float64)
        tdist.all_reduce(t)
        return t.tolist()

    def _max(self, value: float) -> float:
        if not self.dist.distributed:
            return value
        import torch.distributed as tdist

        t = torch.tensor([value], dtype=torch.float64)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return float(t)

    # -- weights out -------------------------------------------------------------------------------
    def named_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` for every parameter, in the engine's naming (vLLM stacks q/k/v itself).

        With `dtype` (e.g. ``torch.bfloat16`` for a bf16 engine) each tensor is a cast copy; without it the
        tensors are detached views of the live master weights: copy them before the next step.
        """
        for name, param in self.model.named_parameters():
            t = param.detach()
            yield name, (t.to(dtype) if dtype is not None and t.dtype != dtype else t)

    # -- checkpoints -------------------------------------------------------------------------------
    def save_checkpoint(self, path: str | Path) -> Path:
        """Write model, optimizer, step, policy version and RNG state atomically (rank 0; all ranks call)."""
        path = Path(path)
        if self.dist.rank == 0:
            ckpt.save_atomic({
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "step": self.step,
                "policy_version": self.policy_version,
                "rng": ckpt.rng_state(),
                "algorithm": dataclasses.asdict(self.algorithm),
                "model_config": self.model.config.to_dict(),
                "world_size": self.dist.world_size,
            }, path)
        if self.dist.distributed:
            import torch.distributed as tdist

            tdist.barrier()  # nobody moves on (or reads it back) before the file is in place
        return path

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore the state `save_checkpoint` wrote; the next step is the one that would have followed."""
        state = ckpt.load(path)
        def load_weights() -> None:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])

        ckpt.restore(path, self.model_dir, state, load_weights)
        self.step = int(state["step"])
        self.policy_version = int(state["policy_version"])
