"""GRPO / PPO-clip losses against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from sfhpc.config.recipe import AlgorithmSpec
from sfhpc.trainer.losses import (
    algorithm_advantages,
    baseline_advantages,
    group_advantages,
    grpo_loss,
    loss_units,
    policy_loss,
    ppo_clip_loss,
    reply_index,
    token_logprobs,
    turn_advantages,
)


def lp(*values: float) -> torch.Tensor:
    """Per-token logprobs as a leaf that records its gradient."""
    return torch.tensor([list(values)], dtype=torch.float64, requires_grad=True)


def test_clipping_on_both_sides() -> None:
    # ratios 1.5, 0.5, 0.5, 1.5 with advantages +1, -1, +1, -1 and eps 0.2:
    #   r=1.5, A=+1: min(1.5, 1.2)  = 1.2   clipped (upper side), no gradient
    #   r=0.5, A=-1: min(-0.5, -0.8) = -0.8  clipped (lower side), no gradient
    #   r=0.5, A=+1: min(0.5, 0.8)  = 0.5   unclipped, d/dlogp = r*A = 0.5
    #   r=1.5, A=-1: min(-1.5, -1.2) = -1.5  unclipped, d/dlogp = -1.5
    # loss = -(1.2 - 0.8 + 0.5 - 1.5) / 4 = 0.15
    new = lp(math.log(1.5), math.log(0.5), math.log(0.5), math.log(1.5))
    out = policy_loss(new, torch.zeros(1, 4, dtype=torch.float64), torch.tensor([[1.0, -1.0, 1.0, -1.0]]),
                      torch.ones(1, 4, dtype=torch.bool), AlgorithmSpec(clip_ratio=0.2))
    assert out.loss.item() == pytest.approx(0.15)
    assert (out.tokens, out.clipped, out.truncated) == (4, 2, 0)
    assert out.ratio_sum == pytest.approx(4.0)
    out.loss.backward()
    assert new.grad.flatten().tolist() == pytest.approx([0.0, 0.0, -0.5 / 4, 1.5 / 4])


def test_asymmetric_clip_range() -> None:
    # eps_low 0.2, eps_high 0.28 (DAPO's "clip higher"): r=1.25 with A=+1 is inside [0.8, 1.28]
    new = lp(math.log(1.25))
    out = policy_loss(new, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([1.0]), torch.ones(1, 1, dtype=bool),
                      AlgorithmSpec(clip_ratio=0.2, clip_ratio_high=0.28))
    assert out.loss.item() == pytest.approx(-1.25)
    assert out.clipped == 0


def test_mask_excludes_prompt_and_padding() -> None:
    # Two scored tokens (ratio 1, A = 2) and masked ones holding garbage: -inf behaviour logprobs, a huge
    # ratio. The loss is the mean over the two scored tokens only, and masked tokens get no gradient.
    new = lp(0.0, -1.0, -1.0, 5.0)
    behaviour = torch.tensor([[float("-inf"), -1.0, -1.0, -30.0]], dtype=torch.float64)
    mask = torch.tensor([[False, True, True, False]])
    out = policy_loss(new, behaviour, torch.tensor([2.0]), mask)
    assert out.loss.item() == pytest.approx(-2.0)
    assert out.tokens == 2
    out.loss.backward()
    assert new.grad.flatten().tolist() == pytest.approx([0.0, -1.0, -1.0, 0.0])
    assert torch.isfinite(new.grad).all()


def test_group_normalisation() -> None:
    # group a: rewards 1 0 0 1 -> mean 0.5, population std 0.5 -> +1 -1 -1 +1
    # group b: 0 0 3 -> mean 1, std sqrt((1 + 1 + 4) / 3) = sqrt 2 -> -1/sqrt2, -1/sqrt2, 2/sqrt2
    # group c: equal rewards -> 0; group d: a single answer -> 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 3.0, 5.0, 5.0, 7.0])
    groups = ["a", "a", "a", "a", "b", "b", "b", "c", "c", "d"]
    adv = group_advantages(rewards, groups, eps=0.0 + 1e-12)
    s = math.sqrt(2.0)
    assert adv.tolist() == pytest.approx([1, -1, -1, 1, -1 / s, -1 / s, 2 / s, 0, 0, 0], abs=1e-6)


def test_the_algorithm_picks_the_advantages() -> None:
    rewards, groups = torch.tensor([1.0, 0.0, 4.0, 4.0]), ["a", "a", "b", "b"]
    grpo = algorithm_advantages(AlgorithmSpec(name="grpo", advantage_eps=1.0), rewards, groups)
    assert grpo.tolist() == pytest.approx([0.5 / 1.5, -0.5 / 1.5, 0.0, 0.0])  # std 0.5 + eps 1
    ppo = algorithm_advantages(AlgorithmSpec(name="ppo"), rewards, groups)
    assert ppo.tolist() == pytest.approx([-1.25, -2.25, 1.75, 1.75])  # minus the batch mean 2.25


def mask(*rows: str) -> torch.Tensor:
    """A generated mask from strings: 'g' a generated token, '.' a prompt or observation token."""
    return torch.tensor([[c == "g" for c in row] for row in rows])


def test_replies_are_runs_of_generated_tokens() -> None:
    assert reply_index(mask(".gg.g..ggg", "..g.......")).tolist() == [
        [-1, 0, 0, -1, 1, -1, -1, 2, 2, 2], [-1, -1, 0, -1, -1, -1, -1, -1, -1, -1]]


def test_credit_per_turn_measures_a_reply_against_the_members_that_made_it() -> None:
    # One group of three episodes: A found the answer at its first reply (1.0), B at its second (0.9),
    # C never (0.0, three replies). Group mean 1.9/3, population std s.
    # turn 0: all three reached it -> baseline 1.9/3; turn 1: B and C -> 0.45; turn 2: C alone -> 0.
    rewards = torch.tensor([1.0, 0.9, 0.0])
    generated = mask(".g......", ".g.g....", ".g.g.g..")
    s = float(rewards.std(correction=0))
    adv = turn_advantages(rewards, ["x"] * 3, generated, eps=0.0)
    m = 1.9 / 3
    assert adv[0].tolist() == pytest.approx([0, (1.0 - m) / s, 0, 0, 0, 0, 0, 0], abs=1e-6)
    assert adv[1].tolist() == pytest.approx([0, (0.9 - m) / s, 0, 0.45 / s, 0, 0, 0, 0], abs=1e-6)
    assert adv[2].tolist() == pytest.approx([0, -m / s, 0, -0.45 / s, 0, 0.0, 0, 0], abs=1e-6)
    # Under episode credit C's second reply would carry -m/s too: the earlier luck of A is what it loses.
    # The pushes of each turn sum to zero.
    turns = reply_index(generated)
    for turn in range(3):
        assert float(adv[turns == turn].sum()) == pytest.approx(0.0, abs=1e-6)


def test_credit_per_turn_through_the_algorithm() -> None:
    rewards, generated = torch.tensor([1.0, 0.0, 2.0, 2.0]), mask(".g.g", ".g..", ".gg.", ".g..")
    grpo = algorithm_advantages(AlgorithmSpec(credit="turn", advantage_eps=1e-9), rewards, ["a", "a", "b", "b"],
                                generated)
    # group a: turn 0 both (mean 0.5, std 0.5) -> +1 / -1; turn 1 only the first -> 0. Group b: equal -> 0.
    assert grpo.flatten().tolist() == pytest.approx([0, 1, 0, 0, 0, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], abs=1e-6)
    ppo = algorithm_advantages(AlgorithmSpec(name="ppo", credit="turn"), rewards, ["a", "a", "b", "b"], generated)
    # the batch is ppo's one group, no division: turn 0 mean 1.25; turn 1 only the first row -> 0
    assert ppo.flatten().tolist() == pytest.approx([0, -0.25, 0, 0, 0, -1.25, 0, 0, 0, 0.75, 0.75, 0, 0, 0.75, 0, 0])
    with pytest.raises(ValueError, match="generated mask"):
        algorithm_advantages(AlgorithmSpec(credit="turn"), rewards, ["a"] * 4)


def test_a_replys_own_reward_is_measured_against_the_replies_at_its_turn() -> None:
    # Three episodes of one group with equal outcomes (so only the replies' own rewards move anything):
    # turn 0: rewards 1, 1, 0 -> mean 2/3, std sqrt(2)/3; turn 1: only rows 0 and 2, rewards 0 and 1 -> -1, +1;
    # turn 2: row 2 alone -> nothing to compare with. Row 1 has no reward for its second reply (NaN).
    rewards = torch.tensor([0.5, 0.5, 0.5])
    generated = mask(".g.g....", ".g.g....", ".g.g.g..")
    nan = float("nan")
    own = torch.tensor([[1.0, 0.0, nan], [1.0, nan, nan], [0.0, 1.0, 1.0]])
    adv = turn_advantages(rewards, ["x"] * 3, generated, eps=1e-9, turn_rewards=own, turn_weight=2.0)
    high, low = (1 / 3) / (2 ** 0.5 / 3), -(2 / 3) / (2 ** 0.5 / 3)
    assert adv[0].tolist() == pytest.approx([0, 2 * high, 0, -2.0, 0, 0, 0, 0], abs=1e-6)
    assert adv[1].tolist() == pytest.approx([0, 2 * high, 0, 0, 0, 0, 0, 0], abs=1e-6)
    assert adv[2].tolist() == pytest.approx([0, 2 * low, 0, 2.0, 0, 0, 0, 0], abs=1e-6)
    # Without the weight the same batch has nothing to learn; through the algorithm the recipe's weight counts.
    assert float(turn_advantages(rewards, ["x"] * 3, generated, turn_rewards=own).abs().sum()) == 0.0
    spec = AlgorithmSpec(credit="turn", turn_reward_weight=2.0, advantage_eps=1e-9)
    assert torch.allclose(algorithm_advantages(spec, rewards, ["x"] * 3, generated, own), adv)


def test_grpo_loss_uses_group_advantages() -> None:
    # two answers of one prompt, rewards 1 and 0 -> advantages +1, -1; one token each at ratio 1
    new = torch.tensor([[-1.0], [-2.0]], dtype=torch.float64, requires_grad=True)
    out = grpo_loss(new, new.detach().clone(), torch.tensor([1.0, 0.0]), ["p", "p"], torch.ones(2, 1, dtype=bool))
    assert out.loss.item() == pytest.approx(0.0)  # -(1 * 1 + 1 * -1) / 2
    out.loss.backward()
    assert new.grad.flatten().tolist() == pytest.approx([-0.5, 0.5], rel=1e-5)  # good answer up, bad down


def test_ppo_clip_with_a_batch_mean_baseline() -> None:
    assert baseline_advantages(torch.tensor([1.0, 2.0, 6.0])).tolist() == pytest.approx([-2.0, -1.0, 3.0])
    new = torch.tensor([[0.0], [0.0]], dtype=torch.float64, requires_grad=True)
    out = ppo_clip_loss(new, torch.zeros(2, 1, dtype=torch.float64), torch.ones(2, 1, dtype=bool),
                        rewards=torch.tensor([3.0, 1.0]))
    assert out.loss.item() == pytest.approx(0.0)  # advantages +1, -1
    given = ppo_clip_loss(lp(0.0), torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=bool),
                          advantages=torch.tensor([[0.5]]))
    assert given.loss.item() == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="advantages or rewards"):
        ppo_clip_loss(lp(0.0), torch.zeros(1, 1), torch.ones(1, 1, dtype=bool))


def test_a_stale_tokens_ratio_corrects_the_update() -> None:
    # A token sampled two versions ago with logprob -1.2 that the current policy gives -1.0:
    # r = e^0.2 = 1.2214. With A = -1: min(-1.2214, -1.2) = -1.2214 -> loss 1.2214, gradient weight r.
    new = lp(-1.0)
    out = policy_loss(new, torch.tensor([[-1.2]], dtype=torch.float64), torch.tensor([-1.0]),
                      torch.ones(1, 1, dtype=bool))
    r = math.exp(0.2)
    assert out.loss.item() == pytest.approx(r)
    out.loss.backward()
    assert new.grad.item() == pytest.approx(r)


def test_a_very_stale_token_is_truncated_at_the_cap() -> None:
    # behaviour -3, current -1: r = e^2 = 7.389 > C = 3. With A = -1 the untruncated surrogate would be
    # -7.389 with gradient weight 7.389; truncated, it is C * A = -3 and the gradient weight is C.
    new = lp(-1.0)
    out = policy_loss(new, torch.tensor([[-3.0]], dtype=torch.float64), torch.tensor([-1.0]),
                      torch.ones(1, 1, dtype=bool), AlgorithmSpec(ratio_cap=3.0))
    assert out.loss.item() == pytest.approx(3.0)
    assert (out.truncated, out.clipped) == (1, 0)
    assert out.ratio_sum == pytest.approx(math.exp(2.0))  # the metric reports the real ratio
    out.loss.backward()
    assert new.grad.item() == pytest.approx(3.0)
    # With A = +1 the upper clip already applies: surrogate (1 + eps) * A, no gradient.
    new = lp(-1.0)
    out = policy_loss(new, torch.tensor([[-3.0]], dtype=torch.float64), torch.tensor([1.0]),
                      torch.ones(1, 1, dtype=bool), AlgorithmSpec(ratio_cap=3.0))
    assert out.loss.item() == pytest.approx(-1.2)
    out.loss.backward()
    assert new.grad.item() == 0.0


def test_kl_penalty_to_a_reference() -> None:
    # ref - new = 0.5: k3 = e^0.5 - 0.5 - 1 = 0.148721; with beta 0.1 over one token the loss adds 0.0148721
    new = lp(-1.0)
    base = policy_loss(new, torch.tensor([[-1.0]], dtype=torch.float64), torch.tensor([0.0]),
                       torch.ones(1, 1, dtype=bool))
    out = policy_loss(new, torch.tensor([[-1.0]], dtype=torch.float64), torch.tensor([0.0]),
                      torch.ones(1, 1, dtype=bool), AlgorithmSpec(kl_coef=0.1),
                      ref_logprobs=torch.tensor([[-0.5]], dtype=torch.float64))
    k3 = math.exp(0.5) - 0.5 - 1.0
    assert out.kl_sum == pytest.approx(k3)
    assert out.loss.item() - base.loss.item() == pytest.approx(0.1 * k3)


def test_normaliser_replaces_the_local_token_count() -> None:
    new = lp(0.0, 0.0)
    out = policy_loss(new, torch.zeros(1, 2, dtype=torch.float64), torch.tensor([1.0]), torch.ones(1, 2, dtype=bool),
                      normaliser=8.0)
    assert out.loss.item() == pytest.approx(-2.0 / 8.0)


def test_sequence_mean_gives_every_sequence_the_weight_of_its_advantage() -> None:
    """A group of two: a long failure (3 tokens, A = -1) and a short success (1 token, A = +1), ratio 1.
    Token mean: -(1 - 3) / 4 = +0.5, the failure's tokens outweigh the success (the batch pushes the
    policy's own replies down). Sequence mean: -((+1) + (-1)) / 2 = 0, each sequence weighs its advantage."""
    mask = torch.tensor([[True, False, False], [True, True, True]])
    advantages = torch.tensor([1.0, -1.0])
    zeros = torch.zeros(2, 3, dtype=torch.float64)
    token = policy_loss(zeros.clone().requires_grad_(), zeros, advantages, mask)
    assert token.loss.item() == pytest.approx(0.5)
    new = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    sequence = policy_loss(new, torch.zeros(2, 3, dtype=torch.float64), advantages, mask,
                           AlgorithmSpec(loss_aggregation="sequence-mean"))
    assert sequence.loss.item() == pytest.approx(0.0)
    assert (sequence.tokens, sequence.ratio_sum) == (4, pytest.approx(4.0))  # statistics stay per token
    sequence.loss.backward()
    # d/dlogp_t = -A_i * w_t / N: the success's one token -1/2, each of the failure's three +1/6
    assert new.grad.flatten().tolist() == pytest.approx([-0.5, 0.0, 0.0, 1 / 6, 1 / 6, 1 / 6])
    assert loss_units(AlgorithmSpec(loss_aggregation="sequence-mean"), mask) == 2.0
    assert loss_units(AlgorithmSpec(), mask) == 4.0


def test_dr_grpo_token_sum_over_a_constant_and_advantages_without_the_std() -> None:
    """Dr. GRPO on the same group: every token's gradient is -A_i / (N L), whatever its sequence's length (the
    sequence mean above gives the short success's token three times the weight of each failure token)."""
    mask = torch.tensor([[True, False, False], [True, True, True]])
    algorithm = AlgorithmSpec(loss_aggregation="token-sum-norm", loss_norm_tokens=4, normalize_std=False)
    new = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    out = policy_loss(new, torch.zeros(2, 3, dtype=torch.float64), torch.tensor([1.0, -1.0]), mask, algorithm)
    assert out.loss.item() == pytest.approx(-(1.0 - 3.0) / 4 / 2)  # sum_i sum_t A_i / L, over N = 2 sequences
    out.loss.backward()
    assert new.grad.flatten().tolist() == pytest.approx([-1 / 8, 0.0, 0.0, 1 / 8, 1 / 8, 1 / 8])
    assert loss_units(algorithm, mask) == 2.0  # data-parallel ranks add sequences
    # Advantages: R - mean within each group, no division by its std.
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.7]), ["a"] * 4 + ["b"] * 2
    got = algorithm_advantages(algorithm, rewards, groups)
    assert got.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, -0.1, 0.1])
    assert algorithm_advantages(AlgorithmSpec(), rewards, groups)[4].item() == pytest.approx(-1.0, rel=1e-4)
    with pytest.raises(ValueError, match="loss_norm_tokens"):
        policy_loss(new, new.detach(), torch.tensor([1.0, -1.0]), mask,
                    AlgorithmSpec(loss_aggregation="token-sum-norm"))


def test_token_logprobs_align_logits_with_the_next_token() -> None:
    # vocab 3: the logits at position t predict token t + 1; position 0 has no context and gets 0
    logits = torch.tensor([[[0.0, 0.0, 1.7346], [5.0, 0.0, 0.0], [9.0, 9.0, 9.0]]])
    tokens = torch.tensor([[1, 2, 0]])
    got = token_logprobs(logits, tokens)
    z0 = torch.log_softmax(logits[0, 0], -1)
    z1 = torch.log_softmax(logits[0, 1], -1)
    assert got.flatten().tolist() == pytest.approx([0.0, z0[2].item(), z1[0].item()])
    tempered = token_logprobs(logits, tokens, temperature=2.0)
    assert tempered[0, 1].item() == pytest.approx(torch.log_softmax(logits[0, 0] / 2, -1)[2].item())
    # Per token: each token at the temperature it was sampled at (token 1 at 0.5, token 2 at 1.5; position 0
    # is never predicted, its entry unused).
    per_token = token_logprobs(logits, tokens, temperature=torch.tensor([[9.0, 0.5, 1.5]]))
    assert per_token.flatten().tolist() == pytest.approx(
        [0.0, torch.log_softmax(logits[0, 0] / 0.5, -1)[2].item(), torch.log_softmax(logits[0, 1] / 1.5, -1)[0].item()])


def test_bad_settings_are_rejected() -> None:
    one = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="algorithm.ratio_cap must be more than 1"):
        policy_loss(one, one, torch.zeros(1), torch.ones(1, 1, dtype=bool), AlgorithmSpec(ratio_cap=1.1))
    with pytest.raises(ValueError, match="algorithm.clip_ratio must be from 0"):
        policy_loss(one, one, torch.zeros(1), torch.ones(1, 1, dtype=bool), AlgorithmSpec(clip_ratio=1.0))
    with pytest.raises(ValueError, match="one shape"):
        policy_loss(torch.zeros(1, 2), one, torch.zeros(1), torch.ones(1, 1, dtype=bool))
    with pytest.raises(ValueError, match="one group per reward"):
        group_advantages(torch.zeros(3), ["a"])
