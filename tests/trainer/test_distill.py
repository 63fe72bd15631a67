"""On-policy distillation on the trainer's side: the teacher's scores (`TeacherScorer`, the forward the trainers
score with) and the advantages they make (`distill_advantages`, through `batch_advantages`, which every backend
uses), on a real built model."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from sfhpc.config.recipe import AlgorithmSpec, DistillSpec
from sfhpc.errors import SfhpcError
from sfhpc.trainer import micro_batches
from sfhpc.trainer.batch import TrainBatch, TrainRow
from sfhpc.trainer.losses import algorithm_advantages, distill_advantages, reverse_kl
from sfhpc.trainer.teacher import TeacherScorer, tokenizer_mismatch
from sfhpc.trainer.torch_trainer import TorchTrainer, batch_advantages
from tests.trainer.conftest import toy_batch


def test_the_teacher_scores_every_token_as_the_trainer_scores_the_policy(tiny_model_dir: Path) -> None:
    """A teacher that is the policy's own folder gives the trainer's log-probabilities, token for token, also
    cut into micro-batches and at other temperatures; padding and the first position score 0."""
    batch = toy_batch(rows=6)
    batch = dataclasses.replace(batch, temperatures=torch.where(batch.generated, 0.7, 1.0))
    ours = TorchTrainer(tiny_model_dir).logprobs(batch)
    whole = TeacherScorer(tiny_model_dir).score(batch)
    pieces = TeacherScorer(tiny_model_dir, chunk_tokens=3, micro_batch_tokens=2 * int(batch.lengths.max())).score(batch)
    assert len(micro_batches.plan_micro_batches(batch.lengths.tolist(), 2 * int(batch.lengths.max()))) == 3
    real = batch.attention_mask.bool()
    assert torch.from_numpy(whole)[real].tolist() == pytest.approx(ours[real].tolist(), abs=1e-5)
    np.testing.assert_allclose(pieces, whole, atol=1e-5)
    assert (whole[:, 0] == 0).all() and (torch.from_numpy(whole)[~real] == 0).all()
    assert (torch.from_numpy(whole)[batch.generated] < 0).all()
    # The policy is its own teacher: no reverse KL beyond the engine's sampling noise (here: made-up logprobs).
    assert reverse_kl(torch.from_numpy(whole), ours, batch.generated) == pytest.approx(0.0, abs=1e-5)


def test_the_reverse_kl_term_joins_each_generated_tokens_advantage() -> None:
    batch = toy_batch(rows=8)
    teacher = torch.where(batch.generated, -1.0, 0.0)
    scored = dataclasses.replace(batch, teacher_logprobs=teacher)
    term = (teacher - batch.behaviour_logprobs) * batch.generated
    task = algorithm_advantages(AlgorithmSpec(group_size=4), batch.rewards, batch.groups)
    added = batch_advantages(scored, AlgorithmSpec(group_size=4, distill=DistillSpec("t", weight=0.5)))
    assert added.shape == batch.tokens.shape
    assert torch.allclose(added, task.unsqueeze(-1) + 0.5 * term)
    pure = batch_advantages(scored, AlgorithmSpec(group_size=4, distill=DistillSpec("t", task_reward=False)))
    assert torch.allclose(pure, term) and bool((pure[batch.generated] > 0).all())  # the teacher likes them more
    assert (pure[~batch.generated] == 0).all()
    assert torch.allclose(distill_advantages(task.unsqueeze(-1).expand_as(term), teacher, batch.behaviour_logprobs,
                                             batch.generated, 0.5), added)
    # The metric: mean over generated tokens of behaviour minus teacher.
    expected = float((batch.behaviour_logprobs + 1.0)[batch.generated].mean())
    assert reverse_kl(teacher, batch.behaviour_logprobs, batch.generated) == pytest.approx(expected)
    with pytest.raises(SfhpcError, match="teacher's log-probabilities, which this batch lacks"):
        batch_advantages(batch, AlgorithmSpec(group_size=4, distill=DistillSpec("t")))


def test_the_teachers_scores_follow_their_rows_into_micro_batches() -> None:
    batch = toy_batch(rows=8)
    teacher = torch.arange(batch.tokens.numel(), dtype=torch.float32).reshape(batch.tokens.shape)
    turns = torch.where(batch.generated, 0, -1)  # per-turn credit's token turns are cut likewise
    scored = dataclasses.replace(batch, teacher_logprobs=teacher, reply_turns=turns)
    pieces = micro_batches.plan_micro_batches(batch.lengths.tolist(), 2 * int(batch.lengths.min()))
    assert len({int(batch.lengths[i].max()) for i in (torch.tensor(p) for p in pieces)}) > 1  # some are trimmed
    for index in pieces:
        piece = micro_batches.trimmed(scored.rows(index))
        assert piece.teacher_logprobs is not None and piece.reply_turns is not None
        assert torch.equal(piece.teacher_logprobs, teacher[index, :piece.tokens.shape[1]])
        assert torch.equal(piece.reply_turns, turns[index, :piece.tokens.shape[1]])
    assert micro_batches.empty_like(scored).teacher_logprobs is None


def test_a_teacher_of_another_tokenizer_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert tokenizer_mismatch(tiny_model_dir, tiny_model_dir) is None
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    tokenizer = other / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text().replace('"<|user|>"', '"<|player|>"'))
    problem = tokenizer_mismatch(other, tiny_model_dir)
    assert problem is not None and "'<|user|>'" in problem and "absent for the teacher" in problem


def test_an_agents_episode_is_distilled_reply_by_reply_and_its_observations_are_context() -> None:
    """Two replies with an observation between, credit per turn: each generated token gets its turn's advantage
    plus its own reverse-KL term; the prompt's and the observation's tokens get nothing."""
    def row(reward: float, group: int) -> TrainRow:
        # prompt (3) | reply 0 (2) | observation (2) | reply 1 (3)
        generated = [False] * 3 + [True] * 2 + [False] * 2 + [True] * 3
        turns = [-1] * 3 + [0, 0] + [-1, -1] + [1, 1, 1]
        return TrainRow(tokens=list(range(1, 11)), generated=generated,
                        logprobs=[-2.0 if g else 0.0 for g in generated], versions=[0 if g else -1 for g in generated],
                        reward=reward, group=group, turns=turns)

    batch = TrainBatch.from_rows([row(1.0, 0), row(0.0, 0)])
    teacher = torch.full(batch.tokens.shape, -0.5) * batch.generated
    scored = dataclasses.replace(batch, teacher_logprobs=teacher)
    spec = AlgorithmSpec(group_size=2, credit="turn")
    task = algorithm_advantages(spec, batch.rewards, batch.groups, batch.generated, None, batch.reply_turns)
    advantages = batch_advantages(scored, dataclasses.replace(spec, distill=DistillSpec("t", weight=2.0)))
    assert torch.allclose(advantages, task + 2.0 * 1.5 * batch.generated)  # teacher -0.5, behaviour -2.0
    assert (advantages[~batch.generated] == task[~batch.generated]).all()
    assert advantages[0, 3].item() == pytest.approx(task[0, 3].item() + 3.0) and task[0, 3] > 0 > task[1, 3]
