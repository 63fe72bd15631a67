"""Micro-batches give the gradient of one pass; the chunked log-probabilities equal the whole logits'."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from sfhpc.config.recipe import AlgorithmSpec, TrainingSpec
from sfhpc.trainer import micro_batches
from sfhpc.trainer.losses import token_logprobs
from sfhpc.trainer.torch_trainer import TorchTrainer
from tests.trainer.conftest import toy_batch


@pytest.mark.parametrize(("lengths", "budget", "want"), [
    ([5, 9, 7, 9], None, [[1, 3, 2, 0]]),  # no budget: one piece, longest rows first
    ([5, 9, 7, 9], 18, [[1, 3], [2, 0]]),  # 2 x 9 fits, a third row of 9 would not; then 7 and 5 (2 x 7)
    ([5, 9, 7, 9], 8, [[1], [3], [2], [0]]),  # a row longer than the budget has a piece of its own
    ([4, 4, 4, 4, 4], 12, [[0, 1, 2], [3, 4]]),
])
def test_rows_are_cut_into_pieces_within_the_budget(lengths: list[int], budget: int | None,
                                                    want: list[list[int]]) -> None:
    assert micro_batches.plan_micro_batches(lengths, budget) == want


def test_pieces_are_trimmed_to_their_longest_row_and_padding_pieces_add_nothing() -> None:
    batch = toy_batch(rows=8, seed=3)
    batch = batch.with_advantages(torch.arange(8, dtype=torch.float32))
    pieces = micro_batches.split(batch, budget=2 * int(batch.lengths.max()))
    assert sorted(r for p in pieces for r in p.rewards.tolist()) == sorted(batch.rewards.tolist())
    for piece in pieces:
        assert piece.tokens.shape[1] == int(piece.lengths.max())
        assert piece.size * piece.tokens.shape[1] <= 2 * int(batch.lengths.max())
    padded = micro_batches.pad_to(pieces, len(pieces) + 2, batch)
    assert len(padded) == len(pieces) + 2
    assert all(p.num_generated == 0 and p.tokens.shape == (1, 1) for p in padded[len(pieces):])


def trained(model_dir: Path, training: TrainingSpec, steps: int = 2) -> tuple[list[dict], dict[str, torch.Tensor]]:
    trainer = TorchTrainer(model_dir, AlgorithmSpec(learning_rate=1e-3), training=training)
    metrics = [trainer.train_step(toy_batch(rows=8, seed=s)).as_dict() for s in range(steps)]
    return metrics, {n: t.clone() for n, t in trainer.named_weights()}


def test_micro_batches_train_as_one_pass(tiny_model_dir: Path) -> None:
    whole_metrics, whole = trained(tiny_model_dir, TrainingSpec(micro_batch_tokens=None))
    # Rows of 11..14 tokens: a budget of 30 makes pieces of two rows, four of them (one pass without it).
    micro_metrics, micro = trained(tiny_model_dir, TrainingSpec(micro_batch_tokens=30, logprob_chunk_tokens=7,
                                                                activation_checkpointing=True))
    assert [m["micro_batches"] for m in whole_metrics] == [1, 1]
    assert all(m["micro_batches"] >= 4 for m in micro_metrics)
    for a, b in zip(whole_metrics, micro_metrics):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["entropy"] == pytest.approx(a["entropy"], rel=1e-5)
        assert a["entropy"] > 0
    for name, value in whole.items():
        torch.testing.assert_close(micro[name], value, rtol=1e-4, atol=1e-5)  # Adam steps of 1e-3
    # The weights moved: the comparison is between two trained models, not two copies of the folder's.
    untouched = TorchTrainer(tiny_model_dir, training=TrainingSpec())
    assert any(not torch.equal(w, whole[n]) for n, w in untouched.named_weights())


def test_chunked_logprobs_equal_those_of_the_whole_logits(tiny_model_dir: Path) -> None:
    trainer = TorchTrainer(tiny_model_dir, training=TrainingSpec(logprob_chunk_tokens=5))
    batch = dataclasses.replace(toy_batch(rows=4, seed=1))
    temperatures = torch.where(batch.generated, 0.7, 1.0)
    batch = dataclasses.replace(batch, temperatures=temperatures)
    chunked = trainer.logprobs(batch)
    with torch.no_grad():
        logits = trainer.model(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits
    whole = token_logprobs(logits, batch.tokens, temperatures)
    mask = batch.attention_mask.bool()
    torch.testing.assert_close(chunked[mask], whole[mask], rtol=1e-5, atol=1e-5)


def test_training_settings_are_checked() -> None:
    from sfhpc.config.schema import Where

    with pytest.raises(Exception, match="micro_batch_tokens"):
        TrainingSpec(micro_batch_tokens=0).validate(Where("recipe.yaml", "training", None))
    assert TrainingSpec().compute_precision(on_gpu=True) == "bf16"
    assert TrainingSpec().compute_precision(on_gpu=False) == "float32"
    assert TrainingSpec(precision="bf16").compute_precision(on_gpu=False) == "bf16"
    assert (TrainingSpec().shards(1, on_gpu=False), TrainingSpec().shards(2, on_gpu=False),
            TrainingSpec().shards(1, on_gpu=True), TrainingSpec(sharding="none").shards(4, on_gpu=True)) == (
        False, True, True, False)
