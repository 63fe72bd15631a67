"""The training batch: padded token sequences with what the loss needs per token and per sequence.

One row is one trajectory's current branch, as the trajectory manager records it: token ids, which of
them the policy generated (only those are scored), the engine's sampling logprob, the policy version and
the sampling temperature of each token, the trajectory's reward and its GRPO group. Rows are right-padded,
so every real token keeps its position (the model's position ids are 0..n-1 whatever the padding).

Sampling. The engine's logprob of a token is of the distribution it sampled from, at the temperature its
turn asked for; the trainers score each token at that temperature (``temperatures``), so the two compare.
A segment sampled in a way the trainers cannot reproduce (greedy, or from a top-p nucleus: the trainers
score over the whole vocabulary) is refused here; a run's endpoint refuses such turns before they are
generated (`sfhpc.endpoint.service.SamplingRule`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from sfhpc.data.trajectory import Segment, Trajectory
from sfhpc.trainer.errors import BatchError

if TYPE_CHECKING:
    from sfhpc.trainer.overlong import Overlong

# What fills a row after its end. Masked out of attention and of the loss, so any id the embedding has will
# do; 0 is one in every vocabulary.
PAD_ID = 0
# The temperature of a generated segment whose sampling is unknown: it was recorded before segments held
# their sampling, when every run sampled at 1 (the only temperature its endpoint accepted).
UNRECORDED_TEMPERATURE = 1.0


@dataclasses.dataclass(frozen=True)
class TrainRow:
    """One row before padding (a helper for tests and agents that hold plain lists)."""

    tokens: Sequence[int] | np.ndarray
    generated: Sequence[bool] | np.ndarray
    logprobs: Sequence[float] | np.ndarray
    versions: Sequence[int] | np.ndarray
    reward: float
    group: Hashable = None
    # per token, the temperature it was sampled at (None: all 1)
    temperatures: Sequence[float] | np.ndarray | None = None
    # per reply, its own reward (`Trajectory.turn_rewards`); fewer than the replies: the rest have none
    turn_rewards: Sequence[float] = ()
    # per token, the turn of a generated token, -1 elsewhere (`Trajectory.token_turns`); None: replies are
    # the runs of generated tokens
    turns: Sequence[int] | np.ndarray | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class TrainBatch:
    """Right-padded ``[batch, seq]`` tensors plus per-row rewards and groups.

    ``advantages`` is optional: PPO-clip takes it as given; when it is None, GRPO normalises ``rewards``
    within ``groups`` and PPO-clip subtracts the batch mean.
    """

    tokens: torch.Tensor  # int64 [B, T], PAD_ID after each row's length
    lengths: torch.Tensor  # int64 [B]
    generated: torch.Tensor  # bool [B, T]: the loss mask
    behaviour_logprobs: torch.Tensor  # float32 [B, T]: the engine's sampling logprob, 0 where not generated
    versions: torch.Tensor  # int64 [B, T]: the policy version of each generated token, -1 elsewhere
    rewards: torch.Tensor  # float32 [B]
    groups: tuple[Hashable, ...]  # [B]: GRPO group of each row
    advantages: torch.Tensor | None = None  # float32 [B] or [B, T]
    # float32 [B, T]: the temperature each generated token was sampled at, 1 elsewhere (None: 1 everywhere)
    temperatures: torch.Tensor = None  # type: ignore[assignment]  # filled in __post_init__
    # float32 [B, K]: the reward of each row's reply k (``credit: turn``), NaN where a row has none; None: none
    turn_rewards: torch.Tensor | None = None
    # int64 [B, T]: the turn each generated token belongs to, as the trajectory manager recorded the turns
    # (`Trajectory.token_turns`), -1 elsewhere; None: the runs of generated tokens number the replies
    reply_turns: torch.Tensor | None = None
    # float32 [B, T]: the distillation teacher's log-probability of each token at its sampling temperature
    # (``algorithm.distill``, scored by the teacher role); None: no teacher
    teacher_logprobs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        b, t = self.tokens.shape
        if self.temperatures is None:
            object.__setattr__(self, "temperatures", torch.ones((b, t), dtype=torch.float32))
        elif not bool((self.temperatures > 0).all()):
            raise BatchError("TrainBatch.temperatures must be more than 0 everywhere (1 where nothing was sampled)")
        for name in ("generated", "behaviour_logprobs", "versions", "temperatures", "reply_turns", "teacher_logprobs"):
            if getattr(self, name) is not None and tuple(getattr(self, name).shape) != (b, t):
                raise BatchError(f"TrainBatch.{name} has shape {tuple(getattr(self, name).shape)}, "
                                 f"expected {(b, t)} like tokens")
        if self.turn_rewards is not None and (self.turn_rewards.dim() != 2 or self.turn_rewards.shape[0] != b):
            raise BatchError(f"TrainBatch.turn_rewards has shape {tuple(self.turn_rewards.shape)}, expected "
                             f"({b}, replies)")
        if self.rewards.shape != (b,) or self.lengths.shape != (b,) or len(self.groups) != b:
            raise BatchError(f"TrainBatch needs one reward, length and group per row ({b} rows)")
        if b and bool(self.generated[:, 0].any()):
            raise BatchError("the first token of a row cannot be generated: every row starts with a prompt token")
        positions = torch.arange(t, device=self.tokens.device).unsqueeze(0)
        if bool((self.generated & (positions >= self.lengths.unsqueeze(1))).any()):
            raise BatchError("a generated token lies in a row's padding: check lengths against the generated mask")

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def attention_mask(self) -> torch.Tensor:
        """int64 [B, T]: 1 on real tokens, 0 on padding."""
        return (torch.arange(self.tokens.shape[1], device=self.tokens.device).unsqueeze(0)
                < self.lengths.unsqueeze(1)).long()

    @property
    def num_generated(self) -> int:
        return int(self.generated.sum())

    @classmethod
    def from_rows(cls, rows: Iterable[TrainRow], *, pad_id: int = PAD_ID,
                  advantages: Sequence[float] | None = None) -> TrainBatch:
        """Pad plain rows into a batch."""
        rows = list(rows)
        if not rows:
            raise BatchError("a training batch needs at least one sequence")
        width = max(len(r.tokens) for r in rows)
        b = len(rows)
        tokens = torch.full((b, width), pad_id, dtype=torch.int64)
        generated = torch.zeros((b, width), dtype=torch.bool)
        logprobs = torch.zeros((b, width), dtype=torch.float32)
        versions = torch.full((b, width), -1, dtype=torch.int64)
        temperatures = torch.ones((b, width), dtype=torch.float32)
        for i, r in enumerate(rows):
            n = len(r.tokens)
            temps = np.ones(n, np.float32) if r.temperatures is None else np.asarray(r.temperatures, np.float32)
            if not len(r.generated) == len(r.logprobs) == len(r.versions) == len(temps) == n:
                raise BatchError(f"row {i}: {n} tokens but {len(r.generated)} mask entries, {len(r.logprobs)} "
                                 f"logprobs, {len(r.versions)} versions and {len(temps)} temperatures")
            tokens[i, :n] = torch.as_tensor(np.asarray(r.tokens, dtype=np.int64))
            generated[i, :n] = torch.as_tensor(np.asarray(r.generated, dtype=bool))
            logprobs[i, :n] = torch.as_tensor(np.asarray(r.logprobs, dtype=np.float32))
            versions[i, :n] = torch.as_tensor(np.asarray(r.versions, dtype=np.int64))
            temperatures[i, :n] = torch.as_tensor(temps)
        reply_turns = None
        if any(r.turns is not None for r in rows):
            reply_turns = torch.full((b, width), -1, dtype=torch.int64)
            for i, r in enumerate(rows):
                if r.turns is None:
                    raise BatchError(f"row {i} has no turns where other rows of the batch have them")
                if len(r.turns) != len(r.tokens):
                    raise BatchError(f"row {i}: {len(r.tokens)} tokens but {len(r.turns)} turns")
                reply_turns[i, :len(r.tokens)] = torch.as_tensor(np.asarray(r.turns, dtype=np.int64))
        replies = max(len(r.turn_rewards) for r in rows)
        turn_rewards = torch.full((b, replies), float("nan"), dtype=torch.float32) if replies else None
        for i, r in enumerate(rows):
            if turn_rewards is not None and len(r.turn_rewards):
                turn_rewards[i, : len(r.turn_rewards)] = torch.tensor([float(x) for x in r.turn_rewards])
        return cls(tokens=tokens, lengths=torch.tensor([len(r.tokens) for r in rows], dtype=torch.int64),
                   generated=generated, behaviour_logprobs=logprobs, versions=versions,
                   rewards=torch.tensor([float(r.reward) for r in rows], dtype=torch.float32),
                   groups=tuple(r.group if r.group is not None else i for i, r in enumerate(rows)),
                   advantages=None if advantages is None else torch.tensor(advantages, dtype=torch.float32),
                   temperatures=temperatures, turn_rewards=turn_rewards, reply_turns=reply_turns)

    @classmethod
    def from_trajectories(cls, trajectories: Iterable[Trajectory], *, pad_id: int = PAD_ID,
                          overlong: Overlong | None = None) -> TrainBatch:
        """A batch of finished trajectories: each row is the current branch, grouped by ``advantage_group``
        (the GRPO group, and in an episode of several agents the agent). Only the current branch is trained:
        a fork (an agent's history that re-rendered an earlier reply) leaves the replaced tokens on the old
        branch, never trained on; each generated token keeps its turn as recorded (`reply_turns`), so a reply
        after a fork is trained with its own turn's reward and baseline. `overlong`: DAPO's length penalty on
        the rewards and cut replies out of the loss (`sfhpc.trainer.overlong`)."""
        rows = []
        for traj in trajectories:
            if traj.reward is None:
                raise BatchError(f"trajectory {traj.id} has no reward: only finished, rewarded trajectories train")
            shift, keep = overlong.shape(traj) if overlong is not None else (0.0, True)
            rows.append(TrainRow(tokens=traj.context(), generated=traj.generated_mask() & keep,
                                  logprobs=traj.token_logprobs(), versions=traj.token_versions(),
                                  reward=traj.reward + shift, group=traj.advantage_group,
                                  temperatures=token_temperatures(traj), turn_rewards=traj.turn_rewards,
                                  turns=traj.token_turns()))
        return cls.from_rows(rows, pad_id=pad_id)

    def with_advantages(self, advantages: torch.Tensor) -> TrainBatch:
        return dataclasses.replace(self, advantages=advantages)

    def to(self, device: torch.device | str) -> TrainBatch:
        """The same batch with its tensors on `device` (the trainer's); itself when they are there already."""
        if self.tokens.device == torch.device(device):
            return self
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **moved)

    def rows(self, index: Sequence[int]) -> TrainBatch:
        """The sub-batch of the given row indices (advantages follow their rows)."""
        idx = torch.as_tensor(list(index), dtype=torch.int64)
        return TrainBatch(tokens=self.tokens[idx], lengths=self.lengths[idx], generated=self.generated[idx],
                          behaviour_logprobs=self.behaviour_logprobs[idx], versions=self.versions[idx],
                          rewards=self.rewards[idx], groups=tuple(self.groups[i] for i in idx.tolist()),
                          advantages=None if self.advantages is None else self.advantages[idx],
                          temperatures=self.temperatures[idx],
                          turn_rewards=None if self.turn_rewards is None else self.turn_rewards[idx],
                          reply_turns=None if self.reply_turns is None else self.reply_turns[idx],
                          teacher_logprobs=None if self.teacher_logprobs is None else self.teacher_logprobs[idx])


def segment_temperature(trajectory: Trajectory, index: int, segment: Segment) -> float:
    """The temperature a trainer scores generated `segment`'s tokens at: the one they were sampled with.
    Raises BatchError for sampling a trainer cannot reproduce (greedy, or a top-p nucleus)."""
    where = f"trajectory {trajectory.id}, segment {index}"
    if segment.top_p is not None and segment.top_p < 1.0:
        raise BatchError(f"{where} was sampled with top_p {segment.top_p:g}: the trainers score tokens over the "
                         "whole vocabulary, so its logprobs cannot be matched; sample with top_p 1")
    if segment.temperature is None:
        return UNRECORDED_TEMPERATURE
    if not segment.temperature > 0:
        raise BatchError(f"{where} was sampled greedily (temperature {segment.temperature:g}): a deterministic "
                         "choice has no sampling logprob to train on; sample with a temperature above 0")
    return segment.temperature


def token_temperatures(trajectory: Trajectory) -> np.ndarray:
    """Per token of ``trajectory.context()``: the temperature a generated token was sampled at, 1 elsewhere."""
    parts = [np.full(used, segment_temperature(trajectory, i, trajectory.segments[i])
                     if trajectory.segments[i].generated else 1.0, np.float32)
             for i, used in trajectory.branch()]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)
