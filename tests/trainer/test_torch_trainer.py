"""The torch backend: one step's metrics, the weight stream's names, batches from trajectory records and
checkpoints that resume exactly."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from sfhpc.config.recipe import AlgorithmSpec
from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.trajectory import Segment, SegmentKind, Status, Trajectory
from sfhpc.endpoint.service import AgentEndpoint, Sampling, TurnRequest
from sfhpc.engine.scripted import ScriptedEngine
from sfhpc.trainer import checkpoint as ckpt
from sfhpc.trainer.batch import PAD_ID, TrainBatch, TrainRow
from sfhpc.trainer.errors import BatchError, CheckpointError, TrainerError
from sfhpc.trainer.torch_trainer import TorchTrainer
from tests.trainer.conftest import toy_batch

CONFIG = AlgorithmSpec(learning_rate=1e-3)


def weights(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in trainer.named_weights()}


def test_train_step_reports_tokens_ratio_and_staleness(tiny_model_dir: Path) -> None:
    trainer = TorchTrainer(tiny_model_dir, CONFIG, initial_version=5)
    batch = toy_batch(version=3)  # sampled two versions before the weights being trained
    before = weights(trainer)
    with torch.no_grad():
        ratio = torch.exp(trainer.logprobs(batch) - batch.behaviour_logprobs)[batch.generated].mean().item()
    m = trainer.train_step(batch)
    assert (m.step, m.policy_version, trainer.policy_version) == (1, 6, 6)
    assert m.tokens == batch.num_generated and m.sequences == 8
    assert m.mean_staleness == 2.0 and m.max_staleness == 2
    assert m.mean_ratio == pytest.approx(ratio, rel=1e-5)  # exp(new - behaviour) before the update
    assert 0.0 <= m.clip_fraction <= 1.0 and m.reward_mean == pytest.approx(float(batch.rewards.mean()))
    assert any(not torch.equal(before[n], t) for n, t in trainer.named_weights())
    assert json.dumps(m.as_dict())


def test_named_weights_use_the_hf_names_of_the_saved_model(tiny_model_dir: Path) -> None:
    from safetensors import safe_open

    trainer = TorchTrainer(tiny_model_dir, CONFIG)
    named = dict(trainer.named_weights(torch.bfloat16))
    with safe_open(tiny_model_dir / "model.safetensors", "pt") as f:
        saved = set(f.keys())
    assert set(named) == saved
    assert "model.layers.0.self_attn.q_proj.weight" in named and "lm_head.weight" in named
    assert {t.dtype for t in named.values()} == {torch.bfloat16}
    assert {t.dtype for _, t in trainer.named_weights()} == {torch.float32}  # master weights stay float32


def test_checkpoint_resumes_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    batches = [toy_batch(seed=s) for s in range(4)]
    a = TorchTrainer(tiny_model_dir, CONFIG)
    a.train_step(batches[0])
    a.train_step(batches[1])
    path = a.save_checkpoint(tmp_path / "ckpt" / "trainer.pt")
    a.train_step(batches[2])
    b = TorchTrainer(tiny_model_dir, CONFIG)
    b.load_checkpoint(path)
    assert (b.step, b.policy_version) == (2, 2)
    b.train_step(batches[2])
    wa, wb = weights(a), weights(b)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    assert (a.step, a.policy_version) == (b.step, b.policy_version) == (3, 3)
    # optimizer moments too: one more step stays identical
    ma, mb = a.train_step(batches[3]), b.train_step(batches[3])
    assert ma.loss == mb.loss
    assert all(torch.equal(t, weights(b)[n]) for n, t in weights(a).items())
    assert list((tmp_path / "ckpt").iterdir()) == [path]  # no temporary file left behind


def test_checkpoint_write_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = ckpt.save_atomic({"step": 1}, tmp_path / "c.pt")

    def crash(obj: object, f: object) -> None:
        f.write(b"half a checkpoint")  # type: ignore[attr-defined]
        raise KeyboardInterrupt  # killed mid-write

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_atomic({"step": 2}, path)
    monkeypatch.undo()
    assert ckpt.load(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def test_checkpoint_errors_name_the_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = TorchTrainer(tiny_model_dir, CONFIG)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        trainer.load_checkpoint(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="junk.pt: cannot read"):
        trainer.load_checkpoint(tmp_path / "junk.pt")
    other = ckpt.save_atomic({"model": {"w": torch.zeros(1)}, "optimizer": {}, "step": 0, "policy_version": 0,
                              "rng": ckpt.rng_state()}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="does not fit the model"):
        trainer.load_checkpoint(other)
    with pytest.raises(TrainerError, match="no config.json"):
        TorchTrainer(tmp_path, CONFIG)


def test_batch_from_trajectory_records() -> None:
    segments = (Segment.of(SegmentKind.PROMPT, -1, 0, [257, 261, 104, 105, 259, 262]),
                Segment.of(SegmentKind.GENERATED, 0, 6, [79, 75], logprobs=[-0.5, -0.25], versions=[3, 4]),
                Segment.of(SegmentKind.OBSERVATION, 1, 2, [263, 33]),
                Segment.of(SegmentKind.GENERATED, 2, 2, [259], logprobs=[-0.125], versions=4))
    done = Trajectory("t1", segments, group="g", status=Status.FINISHED, reward=1.0, turn_rewards=(0.0, 1.0))
    short = Trajectory("t2", segments[:2], group="g", status=Status.FINISHED, reward=0.0)
    batch = TrainBatch.from_trajectories([done, short])
    # each reply's own reward, NaN where a row has none; a sub-batch keeps its rows'
    assert batch.turn_rewards is not None and batch.turn_rewards[0].tolist() == [0.0, 1.0]
    assert torch.isnan(batch.turn_rewards[1]).all() and batch.rows([0]).turn_rewards.tolist() == [[0.0, 1.0]]
    assert batch.tokens.shape == (2, 11) and batch.lengths.tolist() == [11, 8]
    assert batch.generated[0].tolist() == [False] * 6 + [True, True, False, False, True]
    assert batch.versions[0, 6:].tolist() == [3, 4, -1, -1, 4]
    assert batch.behaviour_logprobs[0, 10].item() == -0.125
    assert batch.tokens[1, 8:].tolist() == [PAD_ID] * 3  # padding (an id every vocabulary has)
    assert batch.attention_mask[1].tolist() == [1] * 8 + [0] * 3
    assert batch.groups == ("g", "g") and batch.rewards.tolist() == [1.0, 0.0]
    with pytest.raises(BatchError, match="no reward"):
        TrainBatch.from_trajectories([Trajectory("t3", segments[:1])])


class ScriptedLogits(torch.nn.Module):
    """The scripted test engine's logits in a causal LM's output shape, so that the trainer's own scoring
    (`TorchTrainer.logprobs`: tempering, log-softmax, alignment) runs on the very distribution the engine
    sampled from. Ids outside the engine's vocabulary get a logit that no temperature brings back."""

    def __init__(self, engine: ScriptedEngine) -> None:
        super().__init__()
        self.engine = engine
        self.vocab_size = max(engine.vocab) + 1

    def forward(self, input_ids: torch.Tensor, **_: Any) -> types.SimpleNamespace:
        b, t = input_ids.shape
        logits = torch.full((b, t, self.vocab_size), -1e4)
        for row in range(b):
            ids = input_ids[row].tolist()
            for pos in range(t):  # the logits at `pos` predict the token after ids[:pos + 1]
                logits[row, pos, list(self.engine.vocab)] = torch.tensor(self.engine.logits(ids[:pos + 1]))
        return types.SimpleNamespace(logits=logits)


def test_logprobs_are_taken_at_the_temperature_each_turn_was_sampled_with(tiny_model_dir: Path) -> None:
    engine, manager = ScriptedEngine(seed=3), TrajectoryManager()
    endpoint = AgentEndpoint(engine, manager)
    prompt = [ord(c) for c in "pick letters: "]

    async def two_turns() -> str:
        first = await endpoint.complete(TurnRequest(tuple(prompt), Sampling(max_tokens=12, temperature=0.7)))
        follow_up = (*prompt, *first.token_ids, *[ord(c) for c in " more: "])
        await endpoint.complete(TurnRequest(follow_up, Sampling(max_tokens=12, temperature=1.3, seed=5),
                                            trajectory_id=first.trajectory_id))
        return first.trajectory_id

    tid = asyncio.run(two_turns())
    manager.finish(tid, reward=1.0)
    trajectory = manager.trajectory(tid)
    generated = [s for s in trajectory.segments if s.generated]
    assert [(s.temperature, s.top_p) for s in generated] == [(0.7, 1.0), (1.3, 1.0)]  # recorded per turn

    batch = TrainBatch.from_trajectories([trajectory])
    mask = batch.generated[0]
    assert batch.temperatures[0, mask].unique().tolist() == pytest.approx([0.7, 1.3])
    assert (batch.temperatures[0, ~mask] == 1.0).all()
    trainer = TorchTrainer(tiny_model_dir, CONFIG)
    with torch.no_grad():
        scored = trainer.logprobs(batch, ScriptedLogits(engine))[0]
        untempered = trainer.logprobs(dataclasses.replace(batch, temperatures=None), ScriptedLogits(engine))[0]
    # The reference: the engine's own tempered distribution at each generated position.
    context = batch.tokens[0].tolist()
    reference = [engine.next_token_logprobs(context[:pos], float(batch.temperatures[0, pos]))[context[pos]]
                 for pos in mask.nonzero().flatten().tolist()]
    assert scored[mask].tolist() == pytest.approx(reference, abs=1e-5)
    assert scored[mask].tolist() == pytest.approx(batch.behaviour_logprobs[0, mask].tolist(), abs=1e-5)
    # Scored at temperature 1 instead, the ratio of these fresh tokens would be off by far more than numerics.
    assert float((untempered[mask] - batch.behaviour_logprobs[0, mask]).abs().max()) > 0.1


def test_sampling_the_trainer_cannot_reproduce_is_refused_in_the_batch() -> None:
    prompt = Segment.of(SegmentKind.PROMPT, -1, 0, [257, 104])
    def finished(**sampling: float) -> Trajectory:
        reply = Segment.of(SegmentKind.GENERATED, 0, 2, [79, 75], logprobs=[-0.5, -0.25], versions=0, **sampling)
        return Trajectory("t", (prompt, reply), status=Status.FINISHED, reward=1.0)

    with pytest.raises(BatchError, match="trajectory t, segment 1 was sampled with top_p 0.9"):
        TrainBatch.from_trajectories([finished(temperature=1.0, top_p=0.9)])
    with pytest.raises(BatchError, match="sampled greedily"):
        TrainBatch.from_trajectories([finished(temperature=0.0, top_p=1.0)])
    # A segment recorded before segments held their sampling was drawn at 1, the only temperature then.
    assert TrainBatch.from_trajectories([finished()]).temperatures.tolist() == [[1.0, 1.0, 1.0, 1.0]]


def test_bad_batches_are_rejected() -> None:
    row = TrainRow(tokens=[1, 2, 3], generated=[False, True, True], logprobs=[0, -1, -1], versions=[-1, 0, 0],
                   reward=1.0)
    with pytest.raises(BatchError, match="2 logprobs"):
        TrainBatch.from_rows([TrainRow([1, 2, 3], [False, True, True], [0, -1], [-1, 0, 0], 1.0)])
    with pytest.raises(BatchError, match="first token"):
        TrainBatch.from_rows([TrainRow([1, 2], [True, True], [0, -1], [0, 0], 1.0)])
    with pytest.raises(BatchError, match="at least one"):
        TrainBatch.from_rows([])
    assert TrainBatch.from_rows([row, row]).groups == (0, 1)  # no group: each row is a group of its own


def test_the_recipe_algorithm_reaches_the_optimiser(tiny_model_dir: Path) -> None:
    spec = AlgorithmSpec(name="ppo", learning_rate=3e-5, weight_decay=0.01, adam_beta1=0.8, adam_beta2=0.95,
                         adam_eps=1e-6)
    trainer = TorchTrainer(tiny_model_dir, spec)
    assert trainer.algorithm is spec
    group = trainer.optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"], group["eps"]) == (3e-5, 0.01, (0.8, 0.95), 1e-6)
    with pytest.raises(TrainerError, match="algorithm.learning_rate: must be more than 0, found 0.0"):
        TorchTrainer(tiny_model_dir, AlgorithmSpec(learning_rate=0.0))


def test_the_learning_rate_warms_up(tiny_model_dir: Path) -> None:
    spec = AlgorithmSpec(learning_rate=1e-3, warmup_steps=4)
    assert [spec.learning_rate_at(step) for step in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    trainer = TorchTrainer(tiny_model_dir, spec)

    def largest_move() -> float:
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.train_step(toy_batch())
        return max(float((p.detach() - b).abs().max()) for p, b in zip(trainer.model.parameters(), before))

    # Adam's first step moves a weight by about the learning rate whatever its gradient: here the warm-up's.
    assert largest_move() == pytest.approx(2.5e-4, rel=0.05)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(2.5e-4)
    largest_move()
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(5e-4)


def test_max_grad_norm_clips_the_step(tiny_model_dir: Path) -> None:
    def first_moments(max_grad_norm: float) -> tuple[float, torch.Tensor]:
        trainer = TorchTrainer(tiny_model_dir, AlgorithmSpec(learning_rate=1e-3, max_grad_norm=max_grad_norm))
        grad_norm = trainer.train_step(toy_batch()).grad_norm
        # After one step Adam's first moment is (1 - beta1) * the gradient it was given: the clipped one.
        moments = torch.cat([s["exp_avg"].flatten() for s in trainer.optimizer.state.values()])
        return grad_norm, moments / (1 - 0.9)

    free_norm, free = first_moments(1e6)
    clipped_norm, clipped = first_moments(1e-3)
    assert clipped_norm == pytest.approx(free_norm, rel=1e-4)  # the metric is the norm before clipping
    assert free_norm > 1e-3
    assert float(free.norm()) == pytest.approx(free_norm, rel=1e-3)
    assert float(clipped.norm()) == pytest.approx(1e-3, rel=1e-3)  # scaled down to max_grad_norm


def test_kl_reference_and_ppo_advantages(tiny_model_dir: Path) -> None:
    trainer = TorchTrainer(tiny_model_dir, AlgorithmSpec(name="ppo", learning_rate=1e-2, kl_coef=0.1))
    first = trainer.train_step(toy_batch())
    second = trainer.train_step(toy_batch())
    assert first.kl == pytest.approx(0.0, abs=1e-9)  # the reference is the initial policy
    assert second.kl > 0.0  # after one update the policy has moved away from it
