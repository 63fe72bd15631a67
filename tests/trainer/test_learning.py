"""GRPO on a verifiable toy reward raises the reward: the losses and the trainer learn, without vLLM.

The policy samples its own answers with a plain sampling loop and records each token's logprob and the
policy version, as the engine would. The sampler is refreshed every second step, so half the batches
are one version stale and go through the importance-ratio correction.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from sfhpc.config.recipe import AlgorithmSpec
from sfhpc.engine.tokenizer import load_tokenizer
from sfhpc.trainer.batch import TrainBatch, TrainRow
from sfhpc.trainer.torch_trainer import TorchTrainer

GROUP, GROUPS, NEW_TOKENS, STEPS = 8, 8, 3, 40


@torch.no_grad()
def sample(model: torch.nn.Module, prompt: list[int], n: int,
           gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` continuations of `prompt` (temperature 1) and the logprob of each sampled token."""
    seq = torch.tensor([prompt] * n)
    logprobs = []
    for _ in range(NEW_TOKENS):
        logp = torch.log_softmax(model(input_ids=seq, use_cache=False).logits[:, -1].float(), -1)
        token = torch.multinomial(logp.exp(), 1, generator=gen)
        logprobs.append(logp.gather(-1, token))
        seq = torch.cat([seq, token], 1)
    return seq, torch.cat(logprobs, 1)


def test_grpo_raises_the_reward_of_a_verifiable_task(tiny_model_dir: Path) -> None:
    torch.set_num_threads(1)
    trainer = TorchTrainer(tiny_model_dir, AlgorithmSpec(learning_rate=3e-3), seed=0)
    tokenizer = load_tokenizer(tiny_model_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say a number."}])
    # The tokens that spell digits only ("7", "12", "305"): the BPE splits numbers into runs of 1-3 digits.
    numbers = {t for t in range(tokenizer.vocab_size) if tokenizer.decode([t]).isdigit()}
    assert 10 <= len(numbers) < tokenizer.vocab_size // 4
    gen = torch.Generator().manual_seed(0)
    sampler, sampler_version = copy.deepcopy(trainer.model).eval(), trainer.policy_version
    rewards, staleness = [], []
    for step in range(STEPS):
        seq, logprobs = sample(sampler, prompt, GROUP * GROUPS, gen)
        reward = torch.tensor([float(int(t) in numbers) for t in seq[:, len(prompt)]])  # the first token is a number
        rows = [TrainRow(tokens=seq[i].tolist(), generated=[False] * len(prompt) + [True] * NEW_TOKENS,
                         logprobs=[0.0] * len(prompt) + logprobs[i].tolist(),
                         versions=[-1] * len(prompt) + [sampler_version] * NEW_TOKENS,
                         reward=float(reward[i]), group=i // GROUP) for i in range(len(seq))]
        metrics = trainer.train_step(TrainBatch.from_rows(rows))
        rewards.append(metrics.reward_mean)
        staleness.append(metrics.mean_staleness)
        if step % 2 == 1:
            sampler.load_state_dict(trainer.model.state_dict())
            sampler_version = trainer.policy_version
    before, after = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"mean reward, first 5 steps {before:.3f}, last 5 steps {after:.3f}")
    assert before < 0.15  # a number is a small share of the vocabulary at random
    assert after > 0.5 and after > before + 0.4
    assert max(staleness) == 1.0 and min(staleness) == 0.0  # stale and fresh batches both trained
