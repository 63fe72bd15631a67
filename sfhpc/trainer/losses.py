"""Policy-gradient losses: GRPO and PPO-clip, corrected for tokens sampled by older policy versions.

Notation, per generated token t of a batch (every tensor is ``[batch, seq]``; only tokens where the
loss mask is true count):

    logp_t    log pi_theta(a_t | s_t)    the trainer's forward on the current weights (carries the gradient)
    beh_t     log mu(a_t | s_t)          recorded by the engine when it sampled the token
    A_t       the advantage              one value per sequence, broadcast to its tokens (or per turn)

Importance ratio. The engine may have sampled a token under an older policy version (asynchronous
pipeline, or a partial rollout continued after a weight swap), so the surrogate is taken with respect to
the *behaviour* policy that really produced the token, not the trainer's current one:

    r_t = exp(logp_t - beh_t)

For a token of the current version ``r_t`` is ~1 (only numerics differ: a bf16 engine against float32
master weights); for a stale token it has drifted, and that drift is the importance correction.

Clipped surrogate (PPO, Schulman et al. 2017), with a lower and an upper clip range:

    s_t = min(r_t * A_t, clip(r_t, 1 - eps_low, 1 + eps_high) * A_t)

Truncated importance weight. A very stale token can have a huge ratio: the behaviour policy gave it a
small probability that the current policy no longer does. With ``A_t > 0`` the clip already bounds it,
but with ``A_t < 0`` PPO's ``min`` keeps the unclipped ``r_t * A_t``, which is unbounded, and a handful of
such tokens would dominate the gradient of the whole batch. So the ratio is truncated at ``C``
(``ratio_cap``) *before* the surrogate, keeping a gradient of the capped size:

    r~_t = r_t * sg(min(1, C / r_t))      value min(r_t, C), gradient min(r_t, C) * grad(logp_t)

(``sg`` stops the gradient). Unlike dual-clip PPO (Ye et al. 2020), which zeroes such a token's gradient,
the truncation keeps pushing the token's probability down, at most with weight ``C``: the same
truncation as V-trace (Espeholt et al. 2018). ``C = 3`` by default, the value dual-clip PPO recommends;
fresh tokens never come near it, so it only acts on stale ones.

Temperature. ``beh_t`` is the logprob of the distribution the engine sampled from, at the temperature
the agent asked for (``tau_t``, recorded per segment), so the trainer scores each token at that same
temperature, ``logp_t = log softmax(z_t / tau_t)[a_t]`` (`token_logprobs`): the ratio compares like with
like at any temperature, and is ~1 for a fresh token.

KL penalty to a reference policy (optional): the non-negative estimator ``k3`` (Schulman 2020),

    kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1

Loss (token mean over every masked token of the batch, so long and short answers weigh per token):

    L = -(1/N) sum_t s~_t + beta * (1/N) sum_t kl_t

or, with ``loss_aggregation: sequence-mean``, the mean over sequences of each sequence's token mean
(``w_t = 1 / |o_i|`` for the tokens of sequence ``i``, ``N`` the number of sequences):

    L = -(1/N) sum_t w_t s~_t + beta * (1/N) sum_t w_t kl_t

or, with ``loss_aggregation: token-sum-norm`` (Dr. GRPO, Liu et al. 2025), each sequence's token sum divided
by one constant ``L`` (``loss_norm_tokens``, by default the reply budget ``budgets.max_new_tokens``), averaged
over the ``N`` sequences (``w_t = 1 / L``):

    L = -(1/N) sum_t s~_t / L + beta * (1/N) sum_t kl_t / L

Under the token mean a sequence weighs by its length. Where the failures are the long sequences (a
multi-turn episode that never finds the answer makes every reply it may, one that does stops early), the
negative advantages then outweigh the positive ones of the same group: the batch as a whole pushes down
the replies the policy writes, and the mass goes to replies it does not write (other tokens, longer
replies). The sequence mean gives each sequence the weight of its advantage, so a group's pushes sum to
zero as GRPO's advantages do.

GRPO (Shao et al. 2024) differs from PPO-clip only in its advantages: a group is the set of answers to
one prompt, and each answer's advantage is its reward normalised within the group (no critic):

    A_i = (R_i - mean_group(R)) / (std_group(R) + eps)

with the population standard deviation; a group whose rewards are all equal (or a group of one) gets
advantage 0 and so no gradient. With ``normalize_std: false`` (Dr. GRPO) the division is left out,
``A_i = R_i - mean_group(R)``: a group whose rewards barely differ (almost all right, or almost all wrong)
is not scaled up to weigh as much as one that is split. Under the sequence mean (GRPO's own ``1 / |o_i|``)
a long reply's tokens weigh less than a short one's, so a long wrong reply is pushed down less per token;
the token mean has no such bias, but its divisor changes with each batch's token count; the token sum over a
constant has neither. PPO-clip here takes the advantages it is given, or ``R_i - mean(R)`` over the batch
(`baseline_advantages`): a baseline without a critic.

Credit per turn (``credit: turn``, `turn_advantages`). In a multi-turn episode every reply gets the
episode's advantage by default, measured against the whole group. A reply at turn ``k`` is only made by the
members still playing at turn ``k``, and their rewards differ from the group's mean for reasons that reply
did not choose: luck at earlier turns (a first guess that happened to be right ends the episode with the
top reward). Per turn, the baseline is the mean reward of the group's members that made a reply ``k``:

    A_{i,k} = (R_i - mean_{j reached k}(R_j)) / (std_group(R) + eps)

so the replies at each turn are compared with the other replies at that turn (the pushes of a turn sum to
zero), and what earlier turns won or lost leaves them. The scale stays the group's. PPO-clip takes the
batch as its one group, without the division.

A reply's own reward (``turn_reward_weight`` = ``w`` > 0). The episode's reward says little about one reply
of eight: whether the secret was found also depends on the replies around it. When the task rewards each
reply too (``StepResult.turn_reward``, or the ``turn_rewards`` an agent program reports: a guess the hints
still allow, a tool call that parsed), that reward ``r_{i,k}`` is compared with the other replies at the
same turn and added:

    A_{i,k} += w * (r_{i,k} - mean_{j reached k}(r_{j,k})) / (std_{j reached k}(r_{j,k}) + eps)

(0 when those replies all scored the same, or when row ``i`` has no reward for reply ``k``). This is the
turn-level advantage of multi-turn agent RL (outcome advantage plus a per-turn one): the outcome keeps
what the recipe optimises, the turn term says which replies moved towards it.

On-policy distillation (``algorithm.distill``, `distill_advantages`). A teacher scores every token the
policy sampled; the reverse KL of the sampling policy to the teacher, estimated per sampled token, is
``log pi_b(y_t) - log pi_T(y_t)`` (both at the token's sampling temperature), and its negative joins the
token's advantage with the weight ``lambda``:

    A_{i,t} = A_i + lambda * (log pi_T(y_t) - log pi_b(y_t))      (task_reward: true)
    A_{i,t} =       lambda * (log pi_T(y_t) - log pi_b(y_t))      (task_reward: false, pure distillation)

The surrogate then raises the probability of tokens the teacher likes more than the policy did, token by
token (Agarwal et al. 2024; the per-token reverse-KL advantage of on-policy distillation), whatever the task
reward said of the whole reply.

The settings (``eps_low`` = ``clip_ratio``, ``eps_high`` = ``clip_ratio_high``, ``C`` = ``ratio_cap``,
``beta`` = ``kl_coef``, the GRPO ``eps`` = ``advantage_eps``, ``L`` = ``loss_norm_tokens``) are the recipe's
`AlgorithmSpec`, taken as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

import torch

from sfhpc.config.recipe import AlgorithmSpec

DEFAULT_ALGORITHM = AlgorithmSpec()


@dataclasses.dataclass(frozen=True)
class LossOutput:
    """The loss to minimise and detached per-batch statistics (sums and counts, so ranks can add them)."""

    loss: torch.Tensor  # scalar, carries the gradient
    tokens: int  # masked tokens that entered the loss
    ratio_sum: float  # sum over masked tokens of the (untruncated) ratio r_t
    clipped: int  # masked tokens whose surrogate took the clipped branch (no gradient from them)
    truncated: int  # masked tokens whose ratio exceeded the cap C
    kl_sum: float  # sum over masked tokens of kl_t (0 without a reference)
    surrogate_sum: float  # sum over masked tokens of s~_t


def group_advantages(rewards: torch.Tensor, groups: Sequence[Hashable], eps: float = 1e-6, *,
                     normalize_std: bool = True) -> torch.Tensor:
    """GRPO advantages: ``(R_i - mean_g) / (std_g + eps)`` within each group ``g`` (population std); without
    `normalize_std`, ``R_i - mean_g`` (Dr. GRPO).

    `rewards` is ``[batch]``; `groups[i]` is the group of answer ``i`` (any hashable, e.g. the trajectory's
    group id). Returns ``[batch]`` float32.
    """
    if rewards.dim() != 1 or len(groups) != rewards.shape[0]:
        raise ValueError(f"need one group per reward: {len(groups)} groups for rewards of shape "
                         f"{tuple(rewards.shape)}")
    rewards = rewards.to(torch.float32)
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    out = torch.zeros_like(rewards)
    for index in members.values():
        idx = torch.tensor(index)
        r = rewards[idx]
        out[idx] = (r - r.mean()) / (r.std(correction=0) + eps) if normalize_std else r - r.mean()
    return out


def baseline_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """PPO-clip advantages without a critic: ``R_i - mean(R)`` over the batch."""
    rewards = rewards.to(torch.float32)
    return rewards - rewards.mean()


def reply_index(generated: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` int64: per generated token, the number of its reply in the row (0 for the first), -1
    where nothing was generated. A reply is a run of consecutive generated tokens (`Trajectory.reply_spans`:
    a weight update or a restart inside a reply does not end it; an observation or a tool result does)."""
    generated = generated.to(torch.bool)
    before = torch.zeros_like(generated)
    before[:, 1:] = generated[:, :-1]
    starts = generated & ~before
    return torch.where(generated, torch.cumsum(starts.long(), dim=1) - 1, -1)


def turn_advantages(rewards: torch.Tensor, groups: Sequence[Hashable], generated: torch.Tensor, *,
                    eps: float = 1e-6, normalise: bool = True, turn_rewards: torch.Tensor | None = None,
                    turn_weight: float = 0.0, reply_turns: torch.Tensor | None = None) -> torch.Tensor:
    """Advantages per token with a baseline per turn (module docstring, "Credit per turn"): the tokens of
    row ``i``'s reply ``k`` get ``R_i`` minus the mean reward of the rows of ``i``'s group that made a reply
    ``k``, divided by the group's reward std (+ `eps`) when `normalise`; plus, with `turn_weight` and
    `turn_rewards` (``[batch, replies]``, NaN where a row has none), the reply's own reward against those
    rows' rewards for reply ``k``. Replies are numbered by `reply_turns` (``[batch, seq]``, the turns the
    trajectory manager recorded, `TrainBatch.reply_turns`) where given, else by runs of generated tokens
    (`reply_index`). Returns ``[batch, seq]`` float32, 0 where nothing was generated."""
    if rewards.dim() != 1 or len(groups) != rewards.shape[0] or generated.shape[0] != rewards.shape[0]:
        raise ValueError(f"need one group and one row per reward: {len(groups)} groups and "
                         f"{generated.shape[0]} rows for rewards of shape {tuple(rewards.shape)}")
    rewards = rewards.to(torch.float32)
    turns = reply_index(generated) if reply_turns is None else torch.where(generated.to(torch.bool), reply_turns, -1)
    made = [set(row[row >= 0].tolist()) for row in turns]  # the replies each row made
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    out = torch.zeros(turns.shape, dtype=torch.float32, device=turns.device)
    for index in members.values():
        r = rewards[torch.tensor(index)]
        scale = float(r.std(correction=0)) + eps if normalise else 1.0
        for turn in set().union(*(made[i] for i in index)):
            reached = [i for i in index if turn in made[i]]
            baseline = float(rewards[torch.tensor(reached)].mean())
            own = reply_reward_advantages(turn_rewards, reached, turn, eps) if turn_weight else {}
            for i in reached:
                out[i][turns[i] == turn] = (float(rewards[i]) - baseline) / scale + turn_weight * own.get(i, 0.0)
    return out


def reply_reward_advantages(turn_rewards: torch.Tensor | None, rows: Sequence[int], turn: int,
                            eps: float) -> dict[int, float]:
    """Row -> its reply `turn`'s own reward, normalised among `rows` that have one for that reply (module
    docstring, "A reply's own reward"); rows without one are left out, and all are 0 when the rewards agree."""
    if turn_rewards is None or turn >= turn_rewards.shape[1]:
        return {}
    scored = [i for i in rows if not bool(torch.isnan(turn_rewards[i, turn]))]
    if len(scored) < 2:
        return {}
    values = turn_rewards[torch.tensor(scored), turn].to(torch.float32)
    spread = float(values.std(correction=0))
    if spread == 0:
        return {}
    mean = float(values.mean())
    return {i: (float(v) - mean) / (spread + eps) for i, v in zip(scored, values.tolist())}


def algorithm_advantages(algorithm: AlgorithmSpec, rewards: torch.Tensor, groups: Sequence[Hashable],
                         generated: torch.Tensor | None = None,
                         turn_rewards: torch.Tensor | None = None,
                         reply_turns: torch.Tensor | None = None) -> torch.Tensor:
    """The advantages `algorithm` trains with when none are given: GRPO's `group_advantages` (with its
    ``advantage_eps``) or PPO-clip's `baseline_advantages`; with ``credit: turn``, `turn_advantages` of the
    `generated` mask (``[batch, seq]``) and the replies' `turn_rewards` (``[batch, replies]``), per token."""
    if algorithm.credit == "turn":
        if generated is None:
            raise ValueError("credit per turn needs the generated mask, to find each row's replies")
        weight = algorithm.turn_reward_weight
        if algorithm.name == "grpo":
            return turn_advantages(rewards, groups, generated, eps=algorithm.advantage_eps,
                                   normalise=algorithm.normalize_std, turn_rewards=turn_rewards, turn_weight=weight,
                                   reply_turns=reply_turns)
        return turn_advantages(rewards, [0] * len(groups), generated, normalise=False, turn_rewards=turn_rewards,
                               turn_weight=weight, reply_turns=reply_turns)
    if algorithm.name == "grpo":
        return group_advantages(rewards, groups, algorithm.advantage_eps, normalize_std=algorithm.normalize_std)
    return baseline_advantages(rewards)


def tempered(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """`logits` ``[batch, seq - 1, vocab]`` (those that predict tokens 1..) divided by the temperature each
    predicted token was sampled at: one number, or ``[batch, seq]`` per token (position 0 unused)."""
    if isinstance(temperature, torch.Tensor):
        per_token = temperature[:, 1:].to(device=logits.device, dtype=logits.dtype)
        return logits / per_token.unsqueeze(-1)
    return logits if temperature == 1.0 else logits / temperature


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                   temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Per-position log-probability of each token given the tokens before it, ``[batch, seq]``, under the
    policy at `temperature` (one number, or ``[batch, seq]``: the temperature each token was sampled at).

    Position 0 has no context and gets 0 (it is a prompt token, masked out anyway). `logits` is the
    model's ``[batch, seq, vocab]`` output; logits at position ``t - 1`` predict token ``t``.
    """
    logits = tempered(logits[:, :-1].float(), temperature)
    picked = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def policy_loss(new_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, algorithm: AlgorithmSpec = DEFAULT_ALGORITHM, *,
                ref_logprobs: torch.Tensor | None = None, normaliser: float | None = None) -> LossOutput:
    """The clipped, truncated surrogate of the module docstring, averaged over masked tokens, with the
    clip ranges, ratio cap and KL coefficient of `algorithm`.

    `advantages` is ``[batch]`` (one per sequence) or ``[batch, seq]`` (per token). `normaliser` replaces
    the local count in the mean (`loss_units`: tokens, or sequences): data-parallel ranks pass the global
    count, so that their averaged gradients equal the gradient of the global mean.
    """
    problems = algorithm.problems()
    if problems:
        key, problem = problems[0]
        raise ValueError(f"algorithm.{key} {problem}")
    clip_low, ratio_cap, kl_coef = algorithm.clip_ratio, algorithm.ratio_cap, algorithm.kl_coef
    clip_high = clip_low if algorithm.clip_ratio_high is None else algorithm.clip_ratio_high
    if new_logprobs.shape != behaviour_logprobs.shape or new_logprobs.shape != mask.shape:
        raise ValueError(f"logprobs and mask must have one shape: {tuple(new_logprobs.shape)}, "
                         f"{tuple(behaviour_logprobs.shape)}, {tuple(mask.shape)}")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.to(new_logprobs.dtype).expand_as(new_logprobs)
    mask = mask.to(torch.bool)
    weight = mask.to(new_logprobs.dtype)
    if algorithm.loss_aggregation == "sequence-mean":
        weight = weight / weight.sum(dim=-1, keepdim=True).clamp(min=1.0)
    elif algorithm.loss_aggregation == "token-sum-norm":
        if algorithm.loss_norm_tokens is None:
            raise ValueError("algorithm.loss_norm_tokens is needed by loss_aggregation token-sum-norm (the recipe "
                             "loader sets it to budgets.max_new_tokens)")
        weight = weight / float(algorithm.loss_norm_tokens)

    # Masked-out positions (prompt, padding) may hold anything, e.g. -inf behaviour logprobs: zero the
    # log-ratio there so no inf/nan reaches the sums or the gradient.
    log_ratio = torch.where(mask, new_logprobs - behaviour_logprobs.to(new_logprobs.dtype), 0.0)
    ratio = torch.exp(log_ratio)
    over_cap = ratio.detach() > ratio_cap
    truncated = ratio * torch.where(over_cap, ratio_cap / ratio.detach(), 1.0)
    unclipped = truncated * advantages
    clipped = truncated.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    took_clip = (clipped < unclipped) & mask

    count = int(mask.sum())
    denom = float(normaliser) if normaliser is not None else max(loss_units(algorithm, mask), 1.0)
    loss = -(surrogate * weight).sum() / denom
    per_token = mask.to(new_logprobs.dtype)  # the statistics stay sums over tokens, whatever the aggregation
    kl_sum = 0.0
    if ref_logprobs is not None and kl_coef != 0.0:
        diff = torch.where(mask, ref_logprobs.to(new_logprobs.dtype) - new_logprobs, 0.0)
        kl = torch.exp(diff) - diff - 1.0
        loss = loss + kl_coef * (kl * weight).sum() / denom
        kl_sum = float((kl.detach() * per_token).sum())
    return LossOutput(
        loss=loss, tokens=count, ratio_sum=float((ratio.detach() * per_token).sum()), clipped=int(took_clip.sum()),
        truncated=int((over_cap & mask).sum()), kl_sum=kl_sum,
        surrogate_sum=float((surrogate.detach() * per_token).sum()))


def loss_units(algorithm: AlgorithmSpec, mask: torch.Tensor) -> float:
    """What the loss is a mean over, in `mask` (``[batch, seq]``, the generated tokens): its tokens, or
    with ``loss_aggregation: sequence-mean`` or ``token-sum-norm`` its sequences that hold any. Data-parallel
    ranks add theirs."""
    if algorithm.loss_aggregation in ("sequence-mean", "token-sum-norm"):
        return float((mask.to(torch.bool).sum(dim=-1) > 0).sum())
    return float(mask.to(torch.bool).sum())


def grpo_loss(new_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, rewards: torch.Tensor,
              groups: Sequence[Hashable], mask: torch.Tensor, algorithm: AlgorithmSpec = DEFAULT_ALGORITHM,
              **kwargs: object) -> LossOutput:
    """GRPO: group-normalised advantages (`group_advantages`) in the clipped surrogate (`policy_loss`)."""
    advantages = group_advantages(rewards, groups, algorithm.advantage_eps, normalize_std=algorithm.normalize_std)
    return policy_loss(new_logprobs, behaviour_logprobs, advantages, mask, algorithm, **kwargs)  # type: ignore[arg-type]


def ppo_clip_loss(new_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
                  algorithm: AlgorithmSpec = DEFAULT_ALGORITHM, *, advantages: torch.Tensor | None = None,
                  rewards: torch.Tensor | None = None, **kwargs: object) -> LossOutput:
    """PPO-clip with the given advantages, or with `baseline_advantages` of `rewards` when none are given."""
    if advantages is None:
        if rewards is None:
            raise ValueError("ppo_clip_loss needs advantages or rewards")
        advantages = baseline_advantages(rewards)
    return policy_loss(new_logprobs, behaviour_logprobs, advantages, mask, algorithm, **kwargs)  # type: ignore[arg-type]


def distill_advantages(advantages: torch.Tensor | None, teacher_logprobs: torch.Tensor,
                       behaviour_logprobs: torch.Tensor, generated: torch.Tensor, weight: float) -> torch.Tensor:
    """Per-token advantages ``[batch, seq]`` with the distillation term: ``advantages`` (``[batch]`` or
    ``[batch, seq]``; None for pure distillation) plus ``weight * (teacher - behaviour)`` on generated tokens."""
    term = weight * (teacher_logprobs - behaviour_logprobs) * generated
    if advantages is None:
        return term.float()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    return (advantages + term).float()


def reverse_kl(teacher_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, generated: torch.Tensor) -> float:
    """The mean over generated tokens of ``log pi_b - log pi_T``: the estimate of the sampling policy's reverse
    KL to the teacher that a step's metrics report (``distill_kl``); 0 when nothing was generated."""
    count = int(generated.sum())
    return float(((behaviour_logprobs - teacher_logprobs) * generated).sum()) / count if count else 0.0
