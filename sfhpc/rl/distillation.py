"""The controller's side of on-policy distillation (``algorithm.distill``): each step's batch scored by the
teacher ranks before the trainers see it.

The rows go to the teacher ranks in contiguous shares, one share per rank, all sent before any reply is read,
so the ranks score side by side; their log-probabilities ride in the batch to the trainers
(``TrainBatch.teacher_logprobs``, which `sfhpc.trainer.losses.distill_advantages` turns into advantages) and
into the trajectory store with the step's trajectories (``/scores``, scorer ``teacher``: one value per token of
each trajectory's trained branch). The step's metrics row gets ``distill_kl``, the batch's reverse KL to the
teacher per generated token (`sfhpc.trainer.losses.reverse_kl`), and ``teacher_s``, the longest share's scoring.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.trajectory import Trajectory
from sfhpc.rl import messages as msg
from sfhpc.runtime.comm_layout import CommLayout
from sfhpc.trainer.batch import TrainBatch
from sfhpc.trainer.losses import reverse_kl

SCORER = "teacher"  # the scorer's name in the store's /scores table


class Distillation:
    def __init__(self, layout: CommLayout, manager: TrajectoryManager, idle: Callable[[], object]) -> None:
        if not layout.teacher_ranks:
            raise ValueError("distillation needs teacher ranks")
        self.layout, self.manager, self.idle = layout, manager, idle
        self.last: dict[str, float] = {}

    def scored(self, step: int, batch: TrainBatch, trajectories: Sequence[Trajectory]) -> TrainBatch:
        """`batch` (one row per trajectory, in order) with the teacher's log-probabilities of its tokens."""
        started = time.monotonic()
        ranks = self.layout.teacher_ranks
        shares = [share for share in np.array_split(np.arange(batch.size), len(ranks)) if len(share)]
        for rank, share in zip(ranks, shares, strict=False):
            msg.send(self.layout.world, msg.Score(step, batch.rows(share.tolist())), rank)
        teacher = np.zeros(tuple(batch.tokens.shape), np.float32)
        seconds = 0.0
        for rank, share in zip(ranks, shares, strict=False):
            reply = msg.receive_reply(self.layout.world, rank, msg.Scored, idle=self.idle)
            teacher[share, :reply.logprobs.shape[1]] = reply.logprobs
            seconds = max(seconds, reply.seconds)
        lengths = batch.lengths.tolist()
        self.manager.record_scores(step, SCORER, [(t.id, teacher[i, :lengths[i]])
                                                  for i, t in enumerate(trajectories)])
        teacher_logprobs = torch.from_numpy(teacher)
        self.last = {"distill_kl": reverse_kl(teacher_logprobs, batch.behaviour_logprobs, batch.generated),
                     "teacher_s": seconds, "distill_s": time.monotonic() - started}
        return dataclasses.replace(batch, teacher_logprobs=teacher_logprobs)

    def end_step(self) -> dict[str, float]:
        """The step's figures for its metrics row."""
        row, self.last = self.last, {}
        return row
