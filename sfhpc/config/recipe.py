"""The recipe: what an ML engineer writes to describe one RL run.

A recipe names a model, an algorithm, a pipeline mode, budgets, a task and the *roles* of the run with
the capability tags and sizes they need. It never names partitions: `sfhpc.plan.resolve` places the
roles on a cluster through the admin's tag map.

    roles:
      controller: {place_with: trainer}            # one extra rank on the trainer's nodes
      trainer:    {tags: [train], nodes: 1}
      rollout:    {tags: [rollout], nodes: 2, tasks_per_node: 1}

A colocated recipe runs rollout on the trainer's own ranks: ``rollout: {colocate_with: trainer}``.

A recipe with an agent program may give it nodes of its own (a site's CPU partition): ``agents: {tags: [cpu],
nodes: 2}``. Agent hosts are not ranks of the MPI world (`sfhpc.rollout.agent_host`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from sfhpc.config.cluster import check_name
from sfhpc.config.schema import Where, build, doc, setting
from sfhpc.config.yaml_source import read_yaml

RoleName = Literal["controller", "trainer", "rollout", "teacher", "agents", "reward"]


@dataclasses.dataclass(frozen=True)
class Role:
    """One kind of rank and where it runs.

    A role is placed in one of three ways: on nodes of its own (``tags`` + ``nodes`` +
    ``tasks_per_node``), as extra ranks on another role's nodes (``place_with`` + ``tasks``), or on
    another role's very ranks (``colocate_with``), which is what makes a recipe colocated.
    """

    name: RoleName = dataclasses.field(metadata=doc("the role: controller (the one rank that runs the RL loop, "
                                                    "trajectory manager and store), trainer, rollout, teacher (the "
                                                    "model that scores the policy's tokens, algorithm.distill), or "
                                                    "agents (nodes of their own for the recipe's agent programs, "
                                                    "outside the MPI world; a reward role is refused: rewards are "
                                                    "computed where episodes play)"))
    tags: tuple[str, ...] = setting((), "capability tags every node of this role carries (the cluster map says which "
                                        "pools offer them); needed for a role on nodes of its own")
    nodes: int = setting(1, "nodes of its own (a role with tags)")
    tasks_per_node: int = setting(1, "ranks on each of its nodes")
    tasks: int = setting(1, "ranks it adds to the nodes of the role named by place_with")
    cpus_per_task: int = setting(1, "CPU cores per rank (Slurm's --cpus-per-task)")
    gpus_per_task: int = setting(0, "GPUs per rank; 1 gives every rank a GPU of its own (--gpus-per-task, or "
                                    "--gpus-per-node and CUDA_VISIBLE_DEVICES narrowed per rank where GPU-less ranks "
                                    "share the component)")
    place_with: RoleName | None = setting(None, "another role whose nodes this role joins with `tasks` extra ranks "
                                                "(the controller: place_with: trainer)")
    colocate_with: RoleName | None = setting(None, "another role whose very ranks also play this role (rollout: "
                                                   "{colocate_with: trainer} makes a colocated recipe)")

    @property
    def owns_nodes(self) -> bool:
        return self.place_with is None and self.colocate_with is None

    @property
    def num_tasks(self) -> int:
        """Ranks this role adds to the job (a colocated role adds none)."""
        if self.colocate_with is not None:
            return 0
        return self.tasks if self.place_with is not None else self.nodes * self.tasks_per_node

    def validate(self, where: Where) -> None:
        if self.place_with is not None and self.colocate_with is not None:
            raise where.error("give either place_with or colocate_with, not both")
        if self.name in (self.place_with, self.colocate_with):
            raise where.error("a role cannot be placed with itself")
        if self.owns_nodes and not self.tags:
            raise where.error("needs 'tags' (the capability tags its nodes must carry), "
                              "or 'place_with' / 'colocate_with' another role")
        for tag in self.tags:
            check_name(tag, where.child("tags"), "tag")
        for key in ("nodes", "tasks_per_node", "tasks", "cpus_per_task"):
            if getattr(self, key) < 1:
                raise where.child(key).error(f"must be at least 1, found {getattr(self, key)}")
        if self.gpus_per_task < 0:
            raise where.child("gpus_per_task").error(f"must be 0 or more, found {self.gpus_per_task}")


@dataclasses.dataclass(frozen=True)
class BuildSpec:
    """The tiny model sfhpc builds in the run folder when ``model.path`` is null (`sfhpc.model.tiny`: a BPE
    tokenizer trained on generated text and the task's, a chat template, random weights of
    ``architecture``), and its supervised warm start on the task's reply format. A model folder of your own
    is taken as it is: none of these applies to it."""

    architecture: Literal["llama", "qwen2"] = setting("llama", "the built model's architecture")
    layers: int = setting(4, "the built model's transformer layers")
    hidden_size: int = setting(256, "the built model's hidden size: heads x 64 (vLLM's CPU attention needs 64-wide "
                                    "heads)")
    heads: int = setting(4, "the built model's attention heads")
    tokenizer_vocab: int = setting(512, "the built tokenizer's size: 256 bytes, the chat's special tokens, then merges "
                                        "(264 to 65536; 264: no merges)")
    chat_format: Literal["brief", "brief_tools", "qwen2", "llama", "qwen2_tools", "llama_tools"] = setting(
        "brief", "the built model's chat template: brief (one token per role, the quickest to learn), brief_tools "
                 "(brief with Hermes-style tool calls), qwen2 (ChatML), llama (Llama 3), qwen2_tools (Qwen2.5's, "
                 "with tool calls), llama_tools (Llama 3.1's, with tool calls)")
    warm_start_steps: int = setting(0, "supervised steps on the task's reply format before RL (0: none)")
    warm_start_learning_rate: float = setting(1e-3, "the learning rate of the warm start")

    def validate(self, where: Where) -> None:
        if self.hidden_size != self.heads * 64:
            raise where.child("hidden_size").error(
                f"must be heads x 64 = {self.heads * 64} (vLLM's CPU attention needs 64-wide heads), found "
                f"{self.hidden_size}")
        if not 264 <= self.tokenizer_vocab <= 65536:
            raise where.child("tokenizer_vocab").error(
                f"must be between 264 (the 256 bytes and the chat's special tokens) and 65536, found "
                f"{self.tokenizer_vocab}")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"; `sfhpc.trainer.lora`): the
    model's weights stay frozen and each targeted linear layer learns ``W + (alpha / rank) * B A``, ``A`` of
    ``rank x in`` and ``B`` of ``out x rank``; only ``A`` and ``B`` carry gradients and Adam's state. The
    defaults are PEFT's."""

    rank: int = setting(8, "the adapter's rank r (PEFT's default)")
    alpha: int = setting(8, "the scale's numerator: an adapter adds (alpha / rank) * B A (PEFT's lora_alpha)")
    dropout: float = setting(0.0, "dropout on the adapter's input while training (PEFT's lora_dropout)")
    target_modules: str | tuple[str, ...] | None = setting(
        None, "the linear layers that learn an adapter: their names (q_proj, k_proj, v_proj, o_proj, gate_proj, "
              "up_proj, down_proj), all-linear (every linear layer but the output layer), or null: PEFT's default for "
              "the architecture (q_proj and v_proj for Llama, Qwen2 and Mistral)")

    def validate(self, where: Where) -> None:
        if self.rank < 1:
            raise where.child("rank").error(f"must be at least 1, found {self.rank}")
        if self.alpha < 1:
            raise where.child("alpha").error(f"must be more than 0, found {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise where.child("dropout").error(f"must be from 0 to less than 1, found {self.dropout}")
        if isinstance(self.target_modules, tuple) and not self.target_modules:
            raise where.child("target_modules").error("names no layer: name some, all-linear, or leave it out")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The policy model: a Hugging Face folder (``path``), or, without one, a small one sfhpc builds in the
    run folder as ``build`` says."""

    name: str = setting("tiny-llama", "the model name agents send (\"model\" in a request) and /v1/models lists")
    path: str | None = setting(None, "a Hugging Face causal-LM folder (config.json, safetensors weights, tokenizer, "
                                     "chat template); null: sfhpc builds a tiny model in the run folder (build)")
    max_seq_len: int = setting(256, "the longest sequence, prompt and reply together: vLLM's max_model_len for any "
                                    "model, and the built model's positions")
    dtype: Literal["bfloat16", "float32"] = setting("bfloat16", "the engines' dtype, in which the trainer publishes "
                                                                "the weights (it keeps float32 master weights)")
    tool_parser: Literal["hermes", "llama3_json", "mistral"] | None = setting(
        None, "the format the model writes tool calls in (hermes: Qwen2.5/Qwen3's <tool_call>; llama3_json: Llama "
              "3.1's JSON; mistral: [TOOL_CALLS]); null: read from its chat template")
    build: BuildSpec = setting(BuildSpec(), "the tiny model sfhpc builds when path is null, and its warm start "
                                            "(refused beside path)")
    init_from: str | None = setting(None, "start from a trained policy: a run folder (its newest checkpoint), one of "
                                          "its checkpoints (RUN/checkpoints/step-N), or a PEFT LoRA adapter folder "
                                          "(merged into the local model its adapter_config.json names); its weights, "
                                          "config and tokenizer become this run's model (path and build are left "
                                          "out)")
    lora: LoraSpec | None = setting(None, "train a LoRA adapter on the frozen model instead of every weight (torch "
                                          "backend, not sharded); absent: full fine-tuning")

    def validate(self, where: Where) -> None:
        if self.init_from is not None and (self.path is not None or self.build != BuildSpec()):
            raise where.child("init_from").error(
                "takes the model of the run it names (weights, config, tokenizer); leave path and build out")
        if self.path is not None and self.build != BuildSpec():
            raise where.child("build").error(
                "shapes the model sfhpc builds when path is null; leave it out with a model folder of your own")


@dataclasses.dataclass(frozen=True)
class OverlongSpec:
    """DAPO's over-long handling (Yu et al. 2025, section 3.4; `sfhpc.trainer.overlong`): a soft penalty on
    replies that run into the last `buffer_tokens` of their budget, and/or leaving the replies the budget cut
    out of the loss."""

    buffer_tokens: int = setting(0, "the last tokens of a reply's budget in which its reward falls linearly, to "
                                    "-penalty at the budget (DAPO's soft over-long punishment); 0: none")
    penalty: float = setting(1.0, "the reward taken from a reply that fills its whole budget")
    mask_truncated: bool = setting(False, "leave the replies the length budget cut (finish reason 'length') out of "
                                          "the loss (DAPO's over-long filtering): a cut reply's reward says little "
                                          "about the reply")

    def validate(self, where: Where) -> None:
        if self.buffer_tokens < 0:
            raise where.child("buffer_tokens").error(f"must be 0 or more, found {self.buffer_tokens}")
        if not (math.isfinite(self.penalty) and self.penalty >= 0):
            raise where.child("penalty").error(f"must be 0 or more, found {self.penalty}")
        if not self.buffer_tokens and not self.mask_truncated:
            raise where.error("does nothing: set buffer_tokens above 0 (a soft length penalty), mask_truncated: "
                              "true, or both; or leave the section out")


DAPO_GENERATION_BATCHES = 10  # DAPO's bound: at most this many batches' worth of groups played for one step


@dataclasses.dataclass(frozen=True)
class FilterGroupsSpec:
    """DAPO's dynamic sampling (Yu et al. 2025, section 3.2; `sfhpc.rl.dynamic_sampling`): a group whose
    advantages are all zero (GRPO: every reward of the group agrees) adds nothing to the policy gradient and
    only dilutes the batch; it is kept in the store (status ``filtered``), not trained on, and another group is
    played in its place until the step's batch holds only groups with a signal."""

    max_groups_per_step: int | None = setting(
        None, "groups a step judges, trained and filtered together, before groups without a signal fill the rest of "
              "its batch (counted as filter_fallback_groups; null: 10 x budgets.prompts_per_step, as DAPO's bound of "
              "10 generation batches)")

    def validate(self, where: Where) -> None:
        if self.max_groups_per_step is not None and self.max_groups_per_step < 1:
            raise where.child("max_groups_per_step").error(f"must be at least 1, found {self.max_groups_per_step}")


@dataclasses.dataclass(frozen=True)
class DistillSpec:
    """On-policy distillation (Agarwal et al. 2024, GKD; Gu et al. 2024, MiniLLM): the ``teacher`` role's ranks
    score every token the policy sampled, and the per-token reverse KL to the teacher, ``log pi_teacher(y_t) -
    log pi_behaviour(y_t)`` at the token's sampling temperature, times ``weight``, is added to that token's
    advantage (`sfhpc.trainer.losses.distill_advantages`); with ``task_reward: false`` it is the advantage
    alone (pure distillation). The teacher shares the policy's tokenizer."""

    teacher: str = dataclasses.field(metadata=doc(
        "the teacher: a Hugging Face folder with the policy's tokenizer, or a run folder (its newest checkpoint), one "
        "of its checkpoints (RUN/checkpoints/step-N) or a PEFT LoRA adapter folder, taken into the run folder at "
        "start as model.init_from takes one"))
    weight: float = setting(1.0, "the weight of the reverse-KL term in each generated token's advantage")
    task_reward: bool = setting(True, "add the term to the task reward's advantages; false: the term alone is the "
                                      "advantage (pure distillation: the reward is recorded, not trained on)")

    def validate(self, where: Where) -> None:
        if not self.teacher:
            raise where.child("teacher").error("is empty: name the teacher's model folder or run folder")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise where.child("weight").error(f"must be more than 0, found {self.weight}")


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
    """The RL algorithm, its loss and its optimiser: the one config from the recipe's ``algorithm:``
    section to the loss. Every training backend takes it as it is (the loss is
    `sfhpc.trainer.losses.policy_loss`; its docstring defines the clip ranges, the ratio cap and the KL
    term).

    ``temperature`` is the sampling temperature of an agent's turn that asks for none. The trainer
    recomputes every token's logprob at the temperature that token was sampled with (recorded per
    segment), so agents may ask for any temperature above 0; what the trainer cannot reproduce (greedy
    decoding, a top-p nucleus) is refused by the run's endpoint (`sfhpc.endpoint.service.SamplingRule`).
    """

    name: Literal["grpo", "ppo"] = setting("grpo", "grpo (advantages normalised within each prompt's group) or ppo "
                                                   "(PPO-clip; advantages: reward minus the batch mean)")
    group_size: int = setting(8, "answers per prompt: GRPO normalises rewards within them (GRPO needs at least 2)")
    learning_rate: float = setting(1e-4, "the AdamW learning rate")
    warmup_steps: int = setting(0, "training steps over which the learning rate rises linearly to learning_rate "
                                   "(Adam's first steps move every weight by about the learning rate, whatever the "
                                   "gradient's size; 0: none)")
    lr_schedule: Literal["constant", "linear", "cosine"] = setting(
        "constant", "after the warm-up: constant at learning_rate, or a linear or cosine decay to min_learning_rate "
                    "over lr_decay_steps")
    lr_decay_steps: int = setting(0, "steps of the decay after the warm-up (0: the rest of the run, budgets.steps less "
                                     "warmup_steps); the rate stays at min_learning_rate after them")
    min_learning_rate: float = setting(0.0, "the floor a decaying schedule ends at")
    clip_ratio: float = setting(0.2, "eps_low of the clipped surrogate: the ratio is clipped to [1 - clip_ratio, 1 + "
                                     "clip_ratio_high]")
    clip_ratio_high: float | None = setting(None, "eps_high, the upper clip range (null: clip_ratio; e.g. 0.28 for "
                                                  "DAPO's clip-higher)")
    ratio_cap: float = setting(3.0, "the importance ratio of stale tokens is truncated here before the surrogate (more "
                                    "than 1 + the upper clip)")
    kl_coef: float = setting(0.0, "> 0: a k3 KL penalty to a frozen copy of the initial weights, with this weight")
    loss_aggregation: Literal["token-mean", "sequence-mean", "token-sum-norm"] = setting(
        "token-mean", "how the loss averages: token-mean (every generated token weighs the same), sequence-mean "
                      "(each trajectory's tokens averaged, then the trajectories: every trajectory weighs the same "
                      "whatever its length, so a group's advantages sum to zero in the gradient; for multi-turn "
                      "episodes whose failures are the long ones) or token-sum-norm (each trajectory's token sum "
                      "divided by one constant, loss_norm_tokens, then averaged over the trajectories: no length "
                      "bias either way; Dr. GRPO, Liu et al. 2025)")
    loss_norm_tokens: int | None = setting(
        None, "token-sum-norm's constant divisor (null: budgets.max_new_tokens, the longest reply)")
    normalize_std: bool = setting(
        True, "GRPO: divide a group's advantages by its reward standard deviation; false: R - mean(R) alone, which "
              "does not weigh the groups whose rewards barely differ up (Dr. GRPO, Liu et al. 2025)")
    credit: Literal["episode", "turn"] = setting(
        "episode", "how a multi-turn episode's reward reaches its replies: episode (every reply gets the episode's "
                   "advantage against its group) or turn (a reply at turn k is measured against the group's members "
                   "that made a reply k, so the luck of earlier turns leaves it; for episodes whose length depends "
                   "on the policy)")
    turn_reward_weight: float = setting(
        0.0, "with credit: turn, the weight of each reply's own reward (the task's turn reward, or the turn_rewards "
             "an agent program reports), measured against the group's replies at the same turn and added to the "
             "reply's advantage; 0: the episode's reward only")
    max_grad_norm: float = setting(1.0, "gradient clipping by global norm")
    weight_decay: float = setting(0.0, "AdamW's decoupled weight decay")
    adam_beta1: float = setting(0.9, "AdamW's beta1")
    adam_beta2: float = setting(0.999, "AdamW's beta2")
    adam_eps: float = setting(1e-8, "AdamW's epsilon")
    advantage_eps: float = setting(1e-6, "added to a group's reward standard deviation (GRPO)")
    temperature: float = setting(1.0, "sampling temperature of an agent's turn that asks for none (more than 0, at "
                                      "most 2)")
    overlong: OverlongSpec | None = setting(None, "DAPO's over-long handling: a soft penalty near the reply budget "
                                                  "and/or cut replies left out of the loss (absent: none)")
    filter_groups: FilterGroupsSpec | None = setting(
        None, "DAPO's dynamic sampling: groups without a signal (rewards that all agree) are kept in the store, not "
              "trained, and others played in their place (absent: every complete group trains; {} for the defaults)")
    distill: DistillSpec | None = setting(
        None, "on-policy distillation: a teacher role scores the policy's tokens and the per-token reverse KL to it "
              "joins the advantages (absent: none; needs roles.teacher)")

    def problems(self) -> list[tuple[str, str]]:
        """``(key, problem)`` for every setting out of range (empty when all are good): one check for
        the recipe loader and for trainers built in code."""
        found: list[tuple[str, str]] = []
        if self.name == "grpo" and self.group_size < 2:
            found.append(("group_size", f"must be at least 2 for GRPO, found {self.group_size} (GRPO compares "
                          "the answers to one prompt: a group of one has no advantage to learn from)"))
        elif self.group_size < 1:
            found.append(("group_size", f"must be at least 1, found {self.group_size}"))
        # `not x > 0` rather than `x <= 0`: NaN is refused too.
        for key in ("learning_rate", "max_grad_norm", "adam_eps", "advantage_eps"):
            if not getattr(self, key) > 0:
                found.append((key, f"must be more than 0, found {getattr(self, key)}"))
        if self.warmup_steps < 0:
            found.append(("warmup_steps", f"must be 0 or more, found {self.warmup_steps}"))
        if self.loss_norm_tokens is not None and self.loss_norm_tokens < 1:
            found.append(("loss_norm_tokens", f"must be at least 1, found {self.loss_norm_tokens}"))
        if self.lr_decay_steps < 0:
            found.append(("lr_decay_steps", f"must be 0 or more, found {self.lr_decay_steps}"))
        if not 0 <= self.min_learning_rate <= self.learning_rate:
            found.append(("min_learning_rate", f"must be from 0 to learning_rate ({self.learning_rate:g}), found "
                                               f"{self.min_learning_rate:g}"))
        for key in ("kl_coef", "weight_decay"):
            if not getattr(self, key) >= 0:
                found.append((key, f"must be 0 or more, found {getattr(self, key)}"))
        if not 0 <= self.clip_ratio < 1:
            found.append(("clip_ratio", f"must be from 0 to less than 1 (the ratio is clipped to "
                          f"[1 - clip_ratio, ...]), found {self.clip_ratio}"))
        high = self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high
        if not high >= 0:
            found.append(("clip_ratio_high", f"must be 0 or more (or left out: clip_ratio), found {high}"))
        elif not self.ratio_cap > 1 + high:
            found.append(("ratio_cap", f"must be more than 1 + the upper clip range = {1 + high:g} (the cap "
                          f"truncates ratios the clip would not), found {self.ratio_cap}"))
        for key in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, key) < 1:
                found.append((key, f"must be from 0 to less than 1, found {getattr(self, key)}"))
        if not (math.isfinite(self.turn_reward_weight) and self.turn_reward_weight >= 0):
            found.append(("turn_reward_weight", f"must be 0 or more, found {self.turn_reward_weight}"))
        elif self.turn_reward_weight and self.credit != "turn":
            found.append(("turn_reward_weight", "needs credit: turn (a reply's own reward is measured against the "
                          f"replies at its turn), found credit: {self.credit}"))
        if not 0 < self.temperature <= 2:
            found.append(("temperature", f"must be more than 0 and at most 2, found {self.temperature} "
                          "(greedy decoding, temperature 0, has no sampling distribution to train on)"))
        return found

    def learning_rate_at(self, step: int) -> float:
        """The learning rate of training step `step` (0 the first): the warm-up's linear rise to
        ``learning_rate``, then the schedule's decay to ``min_learning_rate`` (or none). Every training backend
        sets it before each optimiser step."""
        if step < self.warmup_steps:
            return self.learning_rate * (step + 1) / self.warmup_steps
        if self.lr_schedule == "constant" or not self.lr_decay_steps:
            return self.learning_rate
        done = min(1.0, (step - self.warmup_steps) / self.lr_decay_steps)
        shape = 1.0 - done if self.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
        return self.min_learning_rate + (self.learning_rate - self.min_learning_rate) * shape

    def validate(self, where: Where) -> None:
        found = self.problems()
        if found:
            key, problem = found[0]
            raise where.child(key).error(problem)


@dataclasses.dataclass(frozen=True)
class TrainingSpec:
    """The training backend: ``torch`` (CPU default; DDP over gloo across trainer ranks) or ``megatron``
    (megatron-core, for GPUs; trainer ranks = tensor x pipeline x data parallel), or ``timing``, a timing
    model for benchmarks (`sfhpc.trainer.timing_trainer`): it learns nothing, a step lasts what the
    ``timing_model`` section says, and the policy version moves as a real trainer's would."""

    backend: Literal["torch", "megatron", "timing"] = setting("torch", "torch (CPU default; DDP over gloo), megatron "
                                                                       "(megatron-core, for GPUs) or timing (a timing "
                                                                       "model for benchmarks: learns nothing)")
    tensor_parallel: int = setting(1, "megatron: tensor-parallel size (divides the model's key/value heads)")
    pipeline_parallel: int = setting(1, "megatron: pipeline stages (divides the model's layers)")
    checkpoint_every: int = setting(0, "steps between run checkpoints (0: only at the end of the run and at a stop "
                                       "request)")
    keep_checkpoints: int | None = setting(None, "keep the newest N complete checkpoints of this run and remove older "
                                                 "ones after each new one (null: keep all)")
    export_every: int = setting(0, "steps between Hugging Face exports of the policy (exports/step-N, bf16; a "
                                   "checkpoint is written at those steps too, and the final policy is exported at the "
                                   "run's end); 0: none (sfhpc export makes one any time)")
    precision: Literal["auto", "bf16", "float32"] = setting(
        "auto", "the dtype the forward and backward compute in (both backends); master weights and Adam's state stay "
                "float32 (auto: bf16 where the trainer has a GPU, float32 on CPUs)")
    sharding: Literal["auto", "full", "none"] = setting(
        "auto", "torch: full shards parameters, gradients and optimizer state over the trainer ranks (FSDP2; each "
                "rank loads only its shard); none keeps a whole copy on each (DDP); megatron: full shards Adam's state "
                "and the float32 master weights over the data-parallel ranks (its distributed optimizer); auto: full "
                "where the trainers have GPUs or are more than one (megatron: more than one data-parallel replica)")
    micro_batch_tokens: int | None = setting(
        8192, "a rank's rows are trained in micro-batches of at most this many padded tokens, gradients accumulated "
              "(the same gradient as one pass; megatron: equal micro-batches, at least one row each); null: all of a "
              "rank's rows in one pass")
    activation_checkpointing: bool = setting(
        False, "keep only each decoder layer's input for the backward and compute the rest again (about a third more "
               "compute, activations a layer's input per layer; megatron: full recompute, one layer a unit)")
    sequence_parallel: bool = setting(
        True, "megatron with tensor_parallel > 1: split the activations outside the tensor-parallel regions (norms, "
              "dropout, residuals) along the sequence over the tensor-parallel ranks")
    logprob_chunk_tokens: int = setting(
        1024, "torch: positions whose logits are computed at once for the log-probabilities (the [rows, length, "
              "vocab] logits never exist whole)")

    def compute_precision(self, *, on_gpu: bool) -> Literal["bf16", "float32"]:
        """What `precision` means on this trainer: auto is bf16 on a GPU, float32 on a CPU."""
        if self.precision == "auto":
            return "bf16" if on_gpu else "float32"
        return self.precision

    def shards(self, trainer_ranks: int, *, on_gpu: bool, lora: bool = False) -> bool:
        """Whether the trainer shards its state over `trainer_ranks` ranks (`sharding`): the torch backend over
        its trainer ranks, megatron over its data-parallel replicas. A LoRA trainer never shards (`LoraSpec`):
        its frozen weights are compute-dtype copies and its trained state is small."""
        if self.sharding == "auto":
            return not lora and (on_gpu or trainer_ranks > 1)
        return self.sharding == "full"

    def validate(self, where: Where) -> None:
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise where.child("micro_batch_tokens").error(
                f"must be at least 1, found {self.micro_batch_tokens}; null trains a rank's rows in one pass")
        if self.logprob_chunk_tokens < 1:
            raise where.child("logprob_chunk_tokens").error(f"must be at least 1, found {self.logprob_chunk_tokens}")
        if self.export_every < 0:
            raise where.child("export_every").error(f"must be 0 (none) or more, found {self.export_every}")
        if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
            raise where.child("keep_checkpoints").error(
                f"must be at least 1 (the newest checkpoint is what a restart resumes from), found "
                f"{self.keep_checkpoints}; leave it out to keep all")
        for key in ("tensor_parallel", "pipeline_parallel"):
            if getattr(self, key) < 1:
                raise where.child(key).error(f"must be at least 1, found {getattr(self, key)}")
        if self.backend != "megatron" and (self.tensor_parallel, self.pipeline_parallel) != (1, 1):
            raise where.child("backend").error("tensor/pipeline parallelism needs backend 'megatron'")


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    """How rollout and training share time: ``sync`` (generate, then train), ``async`` (overlap under
    a staleness bound) or ``seamless`` (async plus lending idle trainer ranks to rollout: those whose
    nodes the cluster map tags ``rollout``; with none, the run is async and says so)."""

    mode: Literal["sync", "async", "seamless"] = setting("sync", "sync (generate, then train), async (rollout overlaps "
                                                                 "training within max_staleness) or seamless (async, "
                                                                 "and idle trainer ranks tagged rollout are lent to "
                                                                 "rollout)")
    max_staleness: int = setting(1, "how far rollout runs ahead of training: groups are handed out while those that "
                                    "can still be trained within this many versions of their first token are fewer "
                                    "than (max_staleness + 1) steps' worth; a reply that crosses weight updates "
                                    "continues and each token is importance-corrected by the version that sampled it")
    max_token_lag: int | None = setting(None, "drop a group holding a token that lags the policy being trained by more "
                                              "than this many versions; null: no group is dropped for its age")
    rebalance: bool = setting(True, "seamless: a lent rank that runs out of episodes while the trainer waits takes "
                                    "half the running episodes of the most loaded rollout rank, oldest groups first")


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """The rollout engine: ``vllm`` (the policy model served by vLLM), or ``test``, the deterministic test
    engine: not a language model (it writes lower-case letters, its "weights" are a hash of the policy's),
    for exercising the pipeline, preemption and scheduling without vLLM's start-up cost.
    ``token_delay_s`` paces the test engine's generation (0 for vLLM); with ``writes_to_budget`` it never ends
    a reply on its own, so every reply is as long as the task lets it be. As a benchmark's timing model its
    other costs are the ``timing_model`` section's."""

    name: Literal["vllm", "test"] = setting("vllm", "vllm (the policy model served by vLLM) or test (the deterministic "
                                                    "test engine: writes letters, no language model)")
    token_delay_s: float = setting(0.0, "test engine: seconds per decode step")
    writes_to_budget: bool = setting(False, "test engine: never end a reply early, so every reply is as long as the "
                                            "task allows")
    cut_after_tokens: int = setting(0, "test engine: a reply started under weights of version 1 or later waits "
                                       "after this many tokens for the next weight update, which cuts it there "
                                       "(tests of partial rollout); 0: never")
    tensor_parallel_size: int = setting(1, "vLLM: GPUs one engine spans (each rollout rank needs as many: "
                                           "roles.rollout.gpus_per_task)")
    gpu_memory_utilization: float = setting(0.9, "vLLM: the share of each GPU's memory the engine may take (weights "
                                                 "and KV cache)")
    max_num_seqs: int | None = setting(None, "vLLM: the most sequences one engine step holds (null: vLLM's default)")
    enforce_eager: bool = setting(True, "vLLM: no CUDA graphs (false on GPUs: faster decoding, slower start; CPUs "
                                        "ignore it)")
    weight_transport: Literal["auto", "mpi", "torch"] = setting(
        "auto", "how new weights reach the engines: mpi (host memory, MPI broadcast), torch (a torch.distributed "
                "group: NCCL between GPUs, gloo on CPUs; vLLM's workers receive into their own memory), or auto "
                "(torch where the first trainer has CUDA, else mpi)")
    max_restarts: int = setting(0, "vLLM: restart an engine whose process died (killed, out of memory, a device "
                                   "error) inside its rank this many times in a run, with the weights it had (the "
                                   "rank keeps a copy); its generations continue from their prefix on the new "
                                   "one. 0: a dead engine ends the run")
    weight_delta: bool = setting(False, "send each weight version as the bf16 elements that changed since the one "
                                        "before (whole where that is smaller, and the first version whole); each "
                                        "rollout rank keeps a copy of the weights to apply it to and receives the "
                                        "version itself (also under the torch transport)")
    staged_updates: bool = setting(False, "receive each weight version beside the weights the engine serves while it "
                                          "goes on generating with them, then pause it only to load the received "
                                          "version (at one token boundary): under the torch transport into a second "
                                          "copy in the engine's own device memory (the memory plan checks the room), "
                                          "under mpi into the rollout rank's host copy")

    def validate(self, where: Where) -> None:
        if not self.token_delay_s >= 0:
            raise where.child("token_delay_s").error(f"must be 0 or more seconds, found {self.token_delay_s}")
        if self.cut_after_tokens < 0:
            raise where.child("cut_after_tokens").error(f"must be 0 or more, found {self.cut_after_tokens}")
        if self.tensor_parallel_size < 1:
            raise where.child("tensor_parallel_size").error(f"must be at least 1, found {self.tensor_parallel_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise where.child("gpu_memory_utilization").error(
                f"must be more than 0 and at most 1 (a share of the GPU), found {self.gpu_memory_utilization}")
        if self.max_restarts < 0:
            raise where.child("max_restarts").error(f"must be 0 or more, found {self.max_restarts}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise where.child("max_num_seqs").error(f"must be at least 1 (or null), found {self.max_num_seqs}")
        if self.name == "vllm":
            for key in ("token_delay_s", "writes_to_budget", "cut_after_tokens"):
                if getattr(self, key):
                    raise where.child(key).error("paces the 'test' engine only; leave it out for vLLM")
        else:
            for key, default in VLLM_KNOBS.items():
                if getattr(self, key) != default:
                    raise where.child(key).error("configures vLLM only; leave it out for the 'test' engine")


VLLM_KNOBS = {"tensor_parallel_size": 1, "gpu_memory_utilization": 0.9, "max_num_seqs": None, "enforce_eager": True,
              "max_restarts": 0}


@dataclasses.dataclass(frozen=True)
class TimingModelSpec:
    """Benchmarks only (`sfhpc bench pipeline` writes it): what the test engine and the ``timing`` training
    backend stand in for when they model a machine's speed (`sfhpc.engine.scripted`,
    `sfhpc.trainer.timing_trainer`). A decode step lasts ``engine.token_delay_s`` plus ``per_sequence_s``
    for every sequence in flight, a prompt ``prefill_per_token_s`` per token, a weight load
    ``weight_load_s``, a whole version on the network to a rollout rank ``weight_transfer_s``; a training step
    ``train_step_s`` plus ``train_per_token_s`` per trained token over the trainer ranks. A run that trains a
    model leaves this section out."""

    per_sequence_s: float = setting(0.0, "seconds a test-engine decode step adds per sequence in flight")
    prefill_per_token_s: float = setting(0.0, "seconds the test engine spends per prompt token")
    weight_load_s: float = setting(0.0, "seconds the test engine pauses per weight load")
    weight_transfer_s: float = setting(0.0, "seconds one whole weight version takes on the way to a rollout rank (a "
                                            "delta's share of it): the broadcast's network, where the rank receives "
                                            "the version (`sfhpc.weights.paced`)")
    train_step_s: float = setting(0.0, "seconds of every step of the timing training backend")
    train_per_token_s: float = setting(0.0, "seconds per trained token on one rank of the timing training backend")

    ENGINE_KEYS = ("per_sequence_s", "prefill_per_token_s", "weight_load_s", "weight_transfer_s")
    TRAINING_KEYS = ("train_step_s", "train_per_token_s")

    def validate(self, where: Where) -> None:
        for key in (*self.ENGINE_KEYS, *self.TRAINING_KEYS):
            if not getattr(self, key) >= 0:
                raise where.child(key).error(f"must be 0 or more seconds, found {getattr(self, key)}")


@dataclasses.dataclass(frozen=True)
class Budgets:
    """How much work one run does: `steps` training steps of `prompts_per_step` GRPO groups each, and
    when it gives up: an episode after `episode_timeout_s`, the run when more than `max_failed_fraction`
    of the episodes that ended failed, when no rollout rank was heard from for `stall_timeout_s`, or when a
    rank sent no heartbeat for `heartbeat_timeout_s` (`sfhpc.runtime.liveness`)."""

    steps: int = setting(20, "training steps of the run (0, with an evaluation section: evaluate the initial policy, "
                             "e.g. a model.init_from checkpoint, and stop)")
    prompts_per_step: int = setting(16, "GRPO groups (prompts) in one training batch")
    max_new_tokens: int = setting(32, "the most tokens of one policy reply: caps the task's own bound; an agent "
                                      "program is handed it as max_tokens")
    max_choices: int = setting(8, "the most choices (n) one agent call may ask for, each a trajectory of its own "
                                  "in the episode's group")
    wall_minutes: float | None = setting(None, "minutes after which the run ends cleanly, with a final checkpoint "
                                               "(null: no limit)")
    episode_timeout_s: float = setting(600.0, "an episode still playing after this many seconds fails (its group is "
                                              "replaced)")
    max_failed_fraction: float = setting(0.5, "the run stops when more than this share of the ended episodes failed "
                                              "(counted once a step's worth ended; 1: never)")
    stall_timeout_s: float = setting(600.0, "the run stops when no rollout rank was heard from for this many seconds "
                                            "while the controller waits for a batch")
    heartbeat_timeout_s: float = setting(60.0, "the run stops when a rank sent no heartbeat for this many seconds (its "
                                               "process stopped, stuck or cut off; at least 3: ranks beat every "
                                               "second, from a thread of their own, busy or not)")

    def validate(self, where: Where) -> None:
        if self.steps < 0:
            raise where.child("steps").error(f"must be 0 (evaluate only) or more, found {self.steps}")
        for key in ("prompts_per_step", "max_new_tokens", "max_choices"):
            if getattr(self, key) < 1:
                raise where.child(key).error(f"must be at least 1, found {getattr(self, key)}")
        if self.wall_minutes is not None and self.wall_minutes <= 0:
            raise where.child("wall_minutes").error("must be more than 0 (or left out: no limit)")
        for key in ("episode_timeout_s", "stall_timeout_s"):
            if not getattr(self, key) > 0:  # `not >`: NaN is refused too
                raise where.child(key).error(f"must be more than 0 seconds, found {getattr(self, key)}")
        if not self.heartbeat_timeout_s >= 3:  # a bound of a beat or two takes scheduling jitter for silence
            raise where.child("heartbeat_timeout_s").error(
                f"must be at least 3 seconds (ranks beat every second), found {self.heartbeat_timeout_s}")
        if not 0 <= self.max_failed_fraction <= 1:
            raise where.child("max_failed_fraction").error(
                f"must be from 0 (stop at the first failure) to 1 (never stop for failures), found "
                f"{self.max_failed_fraction}")


@dataclasses.dataclass(frozen=True)
class EvaluationSpec:
    """Held-out problems played on the rollout engines every `every` training steps (and before the first),
    never trained on (`sfhpc.rl.evaluation`): pass@1, mean@k and pass@k of the policy the trainer holds then.
    A reply counts as a pass when its reward is at least `pass_reward`. ``temperature: 0`` is greedy decoding,
    which training refuses and evaluation allows (nothing is trained on it)."""

    every: int = setting(10, "training steps between evaluations (the last step is evaluated too, also when "
                             "budgets.wall_minutes ends the run)")
    path: str | None = setting(None, "the held-out data file (.jsonl or .parquet, relative to the recipe's folder; "
                                     "the dataset task's prompt and answer keys; required for the dataset task); a "
                                     "task that generates its problems draws them with a seed of their own")
    problems: int | None = setting(None, "how many problems (the first of the file; null: every row of the file, or "
                                         "64 of a task that generates its problems)")
    samples: int = setting(1, "replies per problem (k of pass@k and mean@k)")
    temperature: float = setting(0.0, "the sampling temperature of evaluation replies (0: greedy; more than 0 when "
                                      "samples is more than 1)")
    pass_reward: float = setting(1.0, "a reply whose reward is at least this passes")
    before_training: bool = setting(True, "evaluate the initial policy before the first step (version 0)")

    def validate(self, where: Where) -> None:
        for key in ("every", "samples"):
            if getattr(self, key) < 1:
                raise where.child(key).error(f"must be at least 1, found {getattr(self, key)}")
        if self.problems is not None and self.problems < 1:
            raise where.child("problems").error(f"must be at least 1 (or null: all), found {self.problems}")
        if not 0 <= self.temperature <= 2:
            raise where.child("temperature").error(f"must be from 0 (greedy) to 2, found {self.temperature}")
        if self.temperature == 0 and self.samples > 1:
            raise where.child("temperature").error(
                f"0 (greedy) gives the same reply {self.samples} times (samples: {self.samples}); set a temperature "
                "above 0 (e.g. 1.0) for pass@k, or samples: 1")
        if not math.isfinite(self.pass_reward):
            raise where.child("pass_reward").error(f"must be a number, found {self.pass_reward}")


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """The environment the agents act in: a built-in task's name, or user code by import path
    (``package.module:Name``, ``file.py:Name``); ``options`` are passed to it as they are. Relative files
    the task names (a ``.py`` file, a data file) are read from `base_dir`, the recipe's folder, which
    `load_recipe` makes absolute (a rank may run in another working folder). An RL run requires a task
    (`sfhpc.rl.program.check_runnable`); ``sfhpc probe`` needs none, so the empty name means "not given"."""

    name: str = setting("", "a built-in task (next-letter, guess-number, dataset, repeat-letter, letter-chain) or "
                            "yours as package.module:Name or file.py:Name; required for an RL run")
    options: Any = setting(None, "a mapping passed to the task as keyword arguments (the dataset task: path, prompt, "
                                 "answer, reward, ...)")
    base_dir: str | None = dataclasses.field(default=None, compare=False, metadata={"yaml": False})


SFHPC_PYTHON = ("python", "python3")  # in an agent command: the interpreter sfhpc runs under
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\*?$")  # agent.env: a variable's name, or a prefix and *


@dataclasses.dataclass(frozen=True)
class AgentSpec:
    """An agent program of the user's own, started per episode (see `sfhpc.rollout.agent_process`): on the
    rollout ranks, beside the engine, or on the agent hosts of an ``agents`` role, nodes of their own
    (`sfhpc.rollout.agent_host`). ``command`` is its argv; at most ``workers`` run at once per rollout rank (per
    agent host with an agents role), and one still running after ``timeout_s`` (default:
    ``budgets.episode_timeout_s``) is killed, its episode failed. The program reaches the endpoint at
    ``OPENAI_BASE_URL``; ``host`` is the address the endpoint binds (default: loopback, or ``0.0.0.0`` with an
    agents role) and ``advertise_host`` the name that URL gives (default: the bound address, or the node's host
    name for ``0.0.0.0``).

    Each episode runs in a working folder of its own under ``workdir``, removed after it, so words of
    ``command`` that name a file or folder in the recipe's folder are passed as absolute paths. A relative
    program path is read from the recipe's folder, a bare name from ``PATH``; a bare ``python`` or ``python3``
    is the interpreter sfhpc runs under (the one with the ``openai`` package sfhpc installs), so a recipe runs
    the same from any shell; name a path for another. With ``container`` the command runs after that prefix
    (``[apptainer, exec, image.sif]``), as the image names it.

    Containment: every process a program starts ends with its episode (``containment``: a cgroup of its own, a
    PID namespace, or its session and descendants); it sees a minimal environment plus the names in ``env``; its
    ``OPENAI_API_KEY`` opens its own episode only; its reward comes from ``reward_source``; the problem's data
    (which holds its answer) is in its input only with ``answer_to_program``."""

    command: tuple[str, ...] = setting((), "the argv of the agent program started once per episode (a relative program "
                                           "path: from the recipe's folder; a bare name: from PATH; a bare python or "
                                           "python3: sfhpc's own interpreter)")
    workers: int = setting(4, "agent programs running at once per rollout rank (per agent host with an agents role)")
    serve: bool = setting(False, "each of the workers is one long-lived program that plays episodes one after "
                                 "another (one episode's JSON per line on stdin) instead of one program per "
                                 "episode: no start-up cost per episode")
    timeout_s: float | None = setting(None, "a program still running after this many seconds is killed and its episode "
                                            "failed (null: budgets.episode_timeout_s)")
    memory_mb: int | None = setting(None, "the address space each agent process may take, in MiB (RLIMIT_AS, which "
                                          "needs no cgroups); null: no limit")
    container: tuple[str, ...] = setting((), "a command prefix that runs the program in a container, e.g. [apptainer, "
                                             "exec, image.sif]; the command then names the image's own programs")
    workdir: str | None = setting(None, "the folder under which each episode gets a working folder of its own, "
                                        "removed after it (null: the node's $TMPDIR, else /tmp)")
    host: str | None = setting(None, "the address the endpoint binds (null: 127.0.0.1, or 0.0.0.0 with an agents role; "
                                     "0.0.0.0: reachable by programs on other nodes)")
    advertise_host: str | None = setting(None, "the host name in the URL handed to programs (null: the bound address, "
                                               "or the node's host name for 0.0.0.0)")
    port: int = setting(0, "the endpoint's TCP port (0: a free one)")
    env: tuple[str, ...] = setting((), "names of environment variables the program gets beside the minimal set "
                                       "(PATH, HOME, LANG, ...: see the agents page); a name may end in * "
                                       "(SLURM_*); secrets (*_API_KEY, *_TOKEN, *_SECRET, WANDB_*, HF_*) pass only "
                                       "when named exactly")
    max_file_mb: int | None = setting(1024, "the largest file each agent process may write, in MiB (RLIMIT_FSIZE); "
                                            "null: no limit")
    max_cpu_s: int | None = setting(3600, "the CPU seconds each agent process may use (RLIMIT_CPU); null: no limit")
    max_processes: int | None = setting(512, "the processes and threads an agent program may add to those its user "
                                             "runs on the node (RLIMIT_NPROC; not applied to root); null: no "
                                             "limit")
    reward_source: Literal["stdout", "post", "verifier"] = setting(
        "stdout", "where an episode's reward comes from: stdout (the program's end line), post (what it POSTs to "
                  "its episode's /reward route; refused otherwise) or verifier (the task's verifier on the final "
                  "reply, whatever the program says); without one, the verifier")
    answer_to_program: bool = setting(False, "the program's input (stdin) carries the problem's data, which holds its "
                                             "answer (a program that plays the environment, as guess-number's); never "
                                             "in the environment")
    containment: Literal["auto", "cgroup", "namespace", "session"] = setting(
        "auto", "how every process of an episode is ended with it: cgroup (a cgroup v2 per episode, where "
                "delegated), namespace (a PID namespace by unshare), session (its session and descendants, tracked); "
                "auto: the first of these the node allows")

    def program(self, recipe_source: str) -> Path | str:
        """The executable `command` starts: a path, or the problem with it (a string)."""
        name = self.command[0]
        if self.container:  # the image's own program: nothing on this node to look for
            return Path(name)
        if name in SFHPC_PYTHON:
            return Path(sys.executable)
        if "/" not in name:
            found = shutil.which(name)
            return Path(found) if found else f"program '{name}' is not on PATH"
        path = Path(name) if Path(name).is_absolute() else Path(recipe_source).resolve().parent / name
        if not path.is_file():
            return f"program {path} does not exist"
        if not os.access(path, os.X_OK):
            return f"program {path} is not executable (chmod +x it, or start it with its interpreter)"
        return path

    def argv(self, recipe_source: str) -> tuple[str, ...]:
        """What is started for an episode: the container prefix, the program, and its words, those naming a
        file or folder in the recipe's folder made absolute (the program runs in a folder of its own)."""
        program = self.program(recipe_source)
        if isinstance(program, str):
            raise ValueError(program)
        folder = Path(recipe_source).resolve().parent
        words = [str(folder / w) if w and not Path(w).is_absolute() and not w.startswith("-")
                 and (folder / w).exists() else w for w in self.command[1:]]
        return (*self.container, str(program), *words)

    def bind_address(self, agent_hosts: bool) -> str:
        """The address the endpoint binds: programs on agent hosts reach it over the network."""
        return self.host or ("0.0.0.0" if agent_hosts else "127.0.0.1")

    def validate(self, where: Where) -> None:
        if not self.command or not self.command[0]:
            raise where.child("command").error("must name the agent program, e.g. [python3, agent.py]")
        program = self.program(where.source)
        if isinstance(program, str):
            raise where.child("command").error(f"{program}; give a path (relative to the recipe's folder) or a "
                                               "command on PATH")
        if self.container and not self.container[0]:
            raise where.child("container").error("must start with the container's program, e.g. [apptainer, exec, "
                                                 "image.sif]")
        if self.workers < 1:
            raise where.child("workers").error(f"must be at least 1, found {self.workers}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise where.child("timeout_s").error(f"must be more than 0 seconds, found {self.timeout_s}")
        if self.memory_mb is not None and self.memory_mb < 16:
            raise where.child("memory_mb").error(f"must be at least 16 MiB (or null: no limit), found {self.memory_mb}")
        if not 0 <= self.port <= 65535:
            raise where.child("port").error(f"must be a TCP port (0: a free one), found {self.port}")
        for key in ("max_cpu_s", "max_processes"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise where.child(key).error(f"must be at least 1 (or null: no limit), found {value}")
        if self.max_file_mb is not None and self.max_file_mb < 1:
            raise where.child("max_file_mb").error(f"must be at least 1 MiB (or null: no limit), found "
                                                   f"{self.max_file_mb}")
        for name in self.env:
            if not ENV_NAME.match(name):
                raise where.child("env").error(f"{name!r} is no environment variable name (letters, digits and "
                                               "'_', not starting with a digit; a trailing * for a prefix)")


@dataclasses.dataclass(frozen=True)
class WandbSpec:
    """Weights & Biases: the run's step metrics, config and reward curve in a wandb run (`sfhpc.rl.trackers`)."""

    project: str = setting("", "the wandb project (required)")
    entity: str | None = setting(None, "the wandb team or user (null: your default)")
    mode: Literal["online", "offline"] = setting("online", "offline: write the run under the run folder only "
                                                           "(`wandb sync` uploads it later)")
    name: str | None = setting(None, "the run's display name (null: the run folder's name)")

    def validate(self, where: Where) -> None:
        if not self.project:
            raise where.child("project").error("required: the wandb project to log to")


@dataclasses.dataclass(frozen=True)
class MlflowSpec:
    """MLflow: the run's step metrics, recipe and reward curve in an MLflow run (`sfhpc.rl.trackers`)."""

    experiment: str = setting("", "the MLflow experiment (made when missing; required)")
    tracking_uri: str | None = setting(None, "where runs are recorded, e.g. http://mlflow:5000 or file:///path/mlruns "
                                             "(null: $MLFLOW_TRACKING_URI, else MLflow's default)")

    def validate(self, where: Where) -> None:
        if not self.experiment:
            raise where.child("experiment").error("required: the MLflow experiment to log to")


@dataclasses.dataclass(frozen=True)
class LoggingSpec:
    """Experiment trackers beside ``metrics.jsonl`` and the TensorBoard file (which every run writes)."""

    wandb: WandbSpec | None = setting(None, "log to Weights & Biases (absent: not)")
    mlflow: MlflowSpec | None = setting(None, "log to MLflow (absent: not)")


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """Slurm job settings that are not placement (placement comes from roles and the tag map).

    A run outlives its allocation: with ``requeue`` (the default) the job is requeued when Slurm preempts
    it, and Slurm signals the batch shell (``USR1``) ``signal_grace_s`` seconds before the time limit so
    the ranks can checkpoint and requeue the job themselves; a run that *fails* is requeued by the batch
    script while the job has been restarted fewer than ``max_restarts`` times (0: never; Slurm's restart
    count holds every requeue, preemptions included). Each restart resumes from the last checkpoint.

    ``setup`` is the one place where a recipe runs shell lines (before srun, as written). Every other
    value is a plain one-line string, refused at load time otherwise, and quoted where it reaches the
    script.
    """

    time_minutes: int = setting(30, "the job's time limit (sbatch --time)")
    job_name: str | None = setting(None, "the Slurm job name (null: sfhpc-<recipe name>)")
    account: str | None = setting(None, "the Slurm account to charge (--account)")
    qos: str | None = setting(None, "the Slurm quality of service (--qos)")
    mpi: str = setting("pmix", "srun's MPI plugin (--mpi)")
    setup: tuple[str, ...] = setting((), "shell lines the batch script runs before srun, as written (e.g. "
                                         "\"module load openmpi\")", shell=True)
    extra_sbatch: tuple[str, ...] = setting((), "extra sbatch flags for component 0, e.g. --reservation=rl (the escape "
                                                "hatch)")
    requeue: bool = setting(True, "the job may be requeued: --requeue, USR1 signal_grace_s before the time limit, a "
                                  "failed run requeues itself")
    signal_grace_s: int = setting(120, "seconds before the time limit at which the batch shell gets USR1 (more than 0, "
                                       "less than time_minutes x 60)")
    max_restarts: int = setting(3, "requeues of a failed run while Slurm's restart count is below this (every requeue "
                                   "counts, preemptions too; 0: never)")

    def validate(self, where: Where) -> None:
        if self.time_minutes < 1:
            raise where.child("time_minutes").error(f"must be at least 1, found {self.time_minutes}")
        limit = self.time_minutes * 60
        # Without requeue no signal is asked for, so the value does not matter then.
        if self.requeue and not 0 < self.signal_grace_s < limit:
            raise where.child("signal_grace_s").error(
                f"must be more than 0 and less than the time limit ({limit} s = time_minutes * 60), found "
                f"{self.signal_grace_s}; lower it or raise time_minutes")
        if self.max_restarts < 0:
            raise where.child("max_restarts").error(f"must be 0 (never) or more, found {self.max_restarts}")


@dataclasses.dataclass(frozen=True)
class AttachSpec:
    """Rollout workers in a Slurm job of their own, outside the run's MPI world, that join the running run and
    leave it when their job ends (`sfhpc attach`, docs/elastic-rollout.md): ``sfhpc launch`` submits their job
    right after the run's, to start once the run's has (``--dependency=after``)."""

    rollout: int = setting(1, "rollout workers (one task each; one GPU each where the pool has GPUs)")
    partition: str | None = setting(None, "their partition (null: the first pool of the cluster map that offers the "
                                          "rollout role's tags)")
    qos: str | None = setting(None, "their job's QOS, e.g. a preemptible one (null: launch.qos)")
    time_minutes: int | None = setting(None, "their job's time limit (null: launch.time_minutes)")

    def validate(self, where: Where) -> None:
        if self.rollout < 1:
            raise where.child("rollout").error(f"must be at least 1 worker, found {self.rollout}")
        if self.time_minutes is not None and self.time_minutes < 1:
            raise where.child("time_minutes").error(f"must be at least 1, found {self.time_minutes}")


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str = dataclasses.field(metadata=doc("the run's name: run folders are <output_dir>/<name>-<time> (letters, "
                                               "digits, '-' and '_')"))
    roles: tuple[Role, ...] = dataclasses.field(metadata=doc("a mapping of role name to placement: controller, "
                                                             "trainer and rollout are required"))
    model: ModelSpec = setting(ModelSpec(), "the policy model: your Hugging Face folder, or the tiny model sfhpc "
                                            "builds")
    algorithm: AlgorithmSpec = setting(AlgorithmSpec(), "the RL loss and its optimiser (one section for every training "
                                                        "backend)")
    training: TrainingSpec = setting(TrainingSpec(), "the training backend, its parallelism and checkpoints")
    pipeline: PipelineSpec = setting(PipelineSpec(), "how rollout and training share time")
    engine: EngineSpec = setting(EngineSpec(), "the rollout engine")
    timing_model: TimingModelSpec = setting(TimingModelSpec(), "benchmarks only: the speeds the test engine and the "
                                                               "timing training backend model")
    budgets: Budgets = setting(Budgets(), "how much work a run does, and when it gives up")
    task: TaskSpec = setting(TaskSpec(), "what the agents learn: the problems and their verifiable reward")
    agent: AgentSpec | None = setting(None, "an agent program of your own plays the episodes (absent: the task's "
                                            "built-in agent)")
    evaluation: EvaluationSpec | None = setting(None, "held-out problems played every N steps and never trained on: "
                                                      "pass@1, mean@k, pass@k in metrics.jsonl (absent: none)")
    launch: LaunchSpec = setting(LaunchSpec(), "Slurm job settings that are not placement")
    attach: AttachSpec | None = setting(None, "rollout workers in a job of their own that sfhpc launch submits beside "
                                              "the run's, joining and leaving the running run (absent: none; sfhpc "
                                              "attach adds some later)")
    logging: LoggingSpec = setting(LoggingSpec(), "experiment trackers (wandb, MLflow) beside metrics.jsonl and "
                                                  "TensorBoard")
    seed: int = setting(0, "seeds the controller's draws of problems, the engines' sampling and the built model")
    output_dir: str = setting("runs", "the folder that run folders are made in (relative to the working folder)")
    output_group: str | None = setting(None, "a Unix group that may read the run folders (mode 2750, that group); "
                                             "null: they are the user's alone (mode 0700)")
    source: str = dataclasses.field(default="", compare=False, metadata={"yaml": False})

    def role(self, name: str) -> Role | None:
        return next((r for r in self.roles if r.name == name), None)

    @property
    def colocated(self) -> bool:
        """True when rollout runs on the trainer's ranks."""
        rollout = self.role("rollout")
        return rollout is not None and rollout.colocate_with == "trainer"

    @property
    def attach_refusal(self) -> str | None:
        """Why rollout workers of other jobs cannot join a run of this recipe (None: they can)."""
        if self.colocated:
            return ("its trainer ranks roll out themselves (colocated), so no rank publishes weights for a worker of "
                    "another job to pull")
        if self.model.lora is not None:
            return "a LoRA run's versions are adapters, which a worker of another job does not merge yet"
        return None

    def validate(self, where: Where) -> None:
        check_name(self.name, where.child("name"), "recipe name")
        if self.attach is not None and self.attach_refusal is not None:
            raise where.child("attach").error(f"is refused: {self.attach_refusal}")
        if self.budgets.steps == 0 and (self.evaluation is None or not self.evaluation.before_training):
            raise where.child("budgets").child("steps").error(
                "0 trains nothing and evaluates only: add an evaluation section (with before_training: true) to "
                "evaluate the initial policy, or train at least 1 step")
        if self.output_group is not None and (not self.output_group or any(
                c.isspace() or c in "/:," for c in self.output_group)):
            raise where.child("output_group").error(f"must be a Unix group's name, found {self.output_group!r}")
        for key, why in _unused_timing(self):
            raise where.child("timing_model").child(key).error(why)
        if self.model.lora is not None:
            here = where.child("model").child("lora")
            if self.engine.weight_delta:
                raise where.child("engine").child("weight_delta").error(
                    "is refused with model.lora: a LoRA version is the adapter alone (already a small part of the "
                    "model), merged whole by each engine; leave weight_delta out")
            if self.engine.max_restarts:
                raise where.child("engine").child("max_restarts").error(
                    "is refused with model.lora: a restarted engine would need the merged weights, which the "
                    "rank does not keep; leave max_restarts out")
            if self.training.backend == "megatron":
                raise here.error("is refused with training.backend megatron (megatron-core has no LoRA layers sfhpc "
                                 "could train; use the torch backend, or full fine-tuning with megatron)")
            if self.training.sharding == "full":
                raise here.error("trains a whole model per rank (the frozen weights in the compute dtype, the small "
                                 "adapter and its Adam state beside them): set training.sharding none or auto")
        filtering = self.algorithm.filter_groups
        if filtering is not None:
            here = where.child("algorithm").child("filter_groups")
            if self.algorithm.name != "grpo":
                raise here.error(f"needs algorithm.name: grpo (a group's agreeing rewards carry no signal only when "
                                 f"advantages are measured within the group), found {self.algorithm.name!r}")
            bound = filtering.max_groups_per_step
            if bound is not None and bound < self.budgets.prompts_per_step:
                raise here.child("max_groups_per_step").error(
                    f"must be at least budgets.prompts_per_step ({self.budgets.prompts_per_step}), the groups one "
                    f"batch trains, found {bound}")
        overlong = self.algorithm.overlong
        if overlong is not None and overlong.buffer_tokens >= self.budgets.max_new_tokens:
            raise where.child("algorithm").child("overlong").child("buffer_tokens").error(
                f"must be less than budgets.max_new_tokens ({self.budgets.max_new_tokens}): the penalty begins this "
                f"many tokens before the reply budget, found {overlong.buffer_tokens}")
        roles = where.child("roles")
        names = [r.name for r in self.roles]
        for required in ("controller", "trainer", "rollout"):
            if required not in names:
                raise roles.error(f"missing role '{required}' (roles: controller, trainer, rollout)")
        if "reward" in names:
            # Placed ranks that do nothing would hold a site's nodes for the whole job.
            raise roles.child("reward").error(
                "is not built: rewards are computed where the episodes play (the task's reward function, or the "
                "agent program's own reward); remove this role")
        for role in self.roles:
            target = role.place_with or role.colocate_with
            if target is None:
                continue
            other = self.role(target)
            if other is None:
                raise roles.child(role.name).error(f"is placed with '{target}', which the recipe lacks")
            if not other.owns_nodes:
                raise roles.child(role.name).error(
                    f"is placed with '{target}', which has no nodes of its own; place it with "
                    f"'{other.place_with or other.colocate_with}' instead")
        self._validate_agents_role(roles)
        self._validate_teacher_role(where)
        controller = self.role("controller")
        assert controller is not None
        if controller.colocate_with is not None or controller.num_tasks != 1:
            raise roles.child("controller").error(
                "the controller is exactly one rank of its own: use 'place_with: trainer' (or tags + nodes: 1)")
        if self.pipeline.mode in ("async", "seamless") and self.colocated:
            raise where.child("pipeline").child("mode").error(
                f"'{self.pipeline.mode}' overlaps rollout with training, so rollout needs ranks of its own; "
                "use mode 'sync' for a colocated recipe or give rollout its own tags and nodes")
        trainer = self.role("trainer")
        assert trainer is not None
        parallel = self.training.tensor_parallel * self.training.pipeline_parallel
        if trainer.num_tasks % parallel:
            raise where.child("training").error(
                f"{trainer.num_tasks} trainer ranks cannot be split into tensor x pipeline = {parallel} groups")
        if self.algorithm.kl_coef and self.training.pipeline_parallel > 1:
            raise where.child("algorithm").child("kl_coef").error(
                f"a KL penalty needs training.pipeline_parallel 1 (the reference's log-probabilities are computed "
                f"on one stage), found {self.training.pipeline_parallel}; set kl_coef: 0 or pipeline_parallel: 1")
        if self.pipeline.max_staleness < 0:
            raise where.child("pipeline").child("max_staleness").error("must be 0 or more")
        if self.pipeline.max_token_lag is not None and self.pipeline.max_token_lag < 0:
            raise where.child("pipeline").child("max_token_lag").error("must be 0 or more (or null: no bound)")
        tp = self.engine.tensor_parallel_size
        engine_role = self.role("trainer") if self.colocated else self.role("rollout")
        assert engine_role is not None
        if tp > 1 and engine_role.gpus_per_task < tp:
            raise where.child("engine").child("tensor_parallel_size").error(
                f"{tp} spans {tp} GPUs, but each {engine_role.name} rank has {engine_role.gpus_per_task}: set "
                f"roles.{engine_role.name}.gpus_per_task: {tp}")


    def _validate_agents_role(self, roles: Where) -> None:
        """The agents role holds agent hosts, which run the recipe's agent program and nothing else: nodes of
        their own, no GPU, and no other role's ranks beside them (those would be ranks of the MPI world)."""
        for role in self.roles:
            if "agents" in (role.place_with, role.colocate_with):
                raise roles.child(role.name).error("cannot be placed with 'agents': agent hosts are not ranks of "
                                                   "the MPI world")
        agents = self.role("agents")
        if agents is None:
            return
        where = roles.child("agents")
        if not agents.owns_nodes:
            raise where.error("runs on nodes of its own: give it tags and nodes (for example tags: [cpu]), not "
                              "place_with or colocate_with")
        if agents.gpus_per_task:
            raise where.child("gpus_per_task").error("agent hosts use no GPU; remove gpus_per_task")
        if self.agent is None:
            raise where.error("holds the recipe's agent programs, but the recipe names none: add agent: {command: "
                              "[...]} or remove this role")

    def _validate_teacher_role(self, where: Where) -> None:
        """A teacher role and ``algorithm.distill`` come together; the teacher is ranks of its own (its model and
        its scoring beside nothing else), on nodes of its own or placed with another role's."""
        teacher, distill = self.role("teacher"), self.algorithm.distill
        roles = where.child("roles")
        if distill is not None and teacher is None:
            raise where.child("algorithm").child("distill").error(
                "needs a teacher role to score the policy's tokens: add roles.teacher (for example {place_with: "
                "trainer} or {tags: [train], nodes: 1})")
        if teacher is None:
            return
        if distill is None:
            raise roles.child("teacher").error("scores tokens for algorithm.distill, which the recipe lacks: add "
                                               "algorithm.distill: {teacher: FOLDER} or remove this role")
        if teacher.colocate_with is not None:
            raise roles.child("teacher").error("runs on ranks of its own: use place_with or tags and nodes, not "
                                               "colocate_with")
        for role in self.roles:
            if "teacher" in (role.place_with, role.colocate_with):
                raise roles.child(role.name).error("cannot be placed with 'teacher': place both with another role")

    @property
    def agent_hosts(self) -> Role | None:
        """The role whose nodes run the agent programs, when they do not run beside the engines."""
        return self.role("agents")


# Keys that were renamed, old -> new, dotted from the recipe's top level (``*``: any role's name). A recipe that
# still uses an old key is refused with "renamed to <new>" instead of "unknown key"; entries stay for good,
# and CHANGELOG.md names the release of each.
RENAMED_KEYS: Mapping[str, str] = {
    # The benchmarks' timing knobs left the sections a run that trains a model uses.
    "engine.per_sequence_s": "timing_model.per_sequence_s",
    "engine.prefill_per_token_s": "timing_model.prefill_per_token_s",
    "engine.weight_load_s": "timing_model.weight_load_s",
    "training.timing_step_s": "timing_model.train_step_s",
    "training.timing_per_token_s": "timing_model.train_per_token_s",
    # The built model's shape and warm start left the keys that a model folder of one's own uses.
    "model.architecture": "model.build.architecture",
    "model.layers": "model.build.layers",
    "model.hidden_size": "model.build.hidden_size",
    "model.heads": "model.build.heads",
    "model.tokenizer_vocab": "model.build.tokenizer_vocab",
    "model.chat_format": "model.build.chat_format",
    "model.warm_start_steps": "model.build.warm_start_steps",
    "model.warm_start_learning_rate": "model.build.warm_start_learning_rate",
}


def _unused_timing(recipe: Recipe) -> Iterator[tuple[str, str]]:
    """The timing-model keys set for a part of the run that does not model time: (key, why not)."""
    for key in TimingModelSpec.ENGINE_KEYS:
        if getattr(recipe.timing_model, key) and recipe.engine.name != "test":
            yield key, f"models the test engine's speed; leave it out for engine '{recipe.engine.name}'"
    for key in TimingModelSpec.TRAINING_KEYS:
        if getattr(recipe.timing_model, key) and recipe.training.backend != "timing":
            yield key, f"models the timing backend's step; leave it out for backend '{recipe.training.backend}'"


def load_recipe(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Recipe:
    """Read and validate a recipe, with `overrides` (dotted keys set over the file's: `sfhpc.config.overrides`);
    raises ConfigError naming file, line and key."""
    data = read_yaml(path)
    if overrides:
        from sfhpc.config import overrides as set_keys

        set_keys.apply(data, overrides, str(path))
    recipe = build(Recipe, data, Where(str(path), "", data.line), renamed=RENAMED_KEYS)
    task = dataclasses.replace(recipe.task, base_dir=str(Path(path).parent.resolve()))
    algorithm = recipe.algorithm
    if algorithm.loss_aggregation == "token-sum-norm" and algorithm.loss_norm_tokens is None:
        algorithm = dataclasses.replace(algorithm, loss_norm_tokens=recipe.budgets.max_new_tokens)
    if algorithm.filter_groups is not None and algorithm.filter_groups.max_groups_per_step is None:
        algorithm = dataclasses.replace(algorithm, filter_groups=FilterGroupsSpec(
            max_groups_per_step=DAPO_GENERATION_BATCHES * recipe.budgets.prompts_per_step))
    if algorithm.lr_schedule != "constant" and not algorithm.lr_decay_steps:
        # A decay over "the rest of the run": the trainers see steps, not the budget.
        algorithm = dataclasses.replace(algorithm,
                                        lr_decay_steps=max(1, recipe.budgets.steps - algorithm.warmup_steps))
    evaluation = recipe.evaluation
    if evaluation is not None and evaluation.path is not None:  # read where the recipe is, from any rank's folder
        evaluation = dataclasses.replace(evaluation, path=str((Path(path).parent / evaluation.path).resolve()))
    return dataclasses.replace(recipe, source=str(path), task=task, algorithm=algorithm, evaluation=evaluation)
