"""The ``timing`` training backend: a timing model of a trainer, for pipeline benchmarks. It learns nothing.

A step sleeps for the modelled time of training the batch (``timing_model.train_step_s`` plus
``timing_model.train_per_token_s`` per trained token, shared by the data-parallel trainer ranks: the costs
come from `sfhpc.sim.cost_model`), then meets the other trainer ranks in an MPI all-reduce (where a real
trainer all-reduces its gradients) and bumps the policy version. What a step reports about its batch is
real: the tokens, the sequences, the reward and the staleness of every generated token against the
version being trained. Its weights are one small tensor that holds the version, so a weight broadcast is
real (and cheap) and engines that hash their weights (the test engine) generate differently per version.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from sfhpc.trainer.batch import TrainBatch
from sfhpc.trainer.torch_trainer import StepMetrics

WEIGHT_NAME = "timing_model.version"  # the one published tensor


class TimingTrainer:
    """Sleeps the modelled step (see the module docstring); `comm` is the trainers' MPI communicator."""

    modelled = True  # its step times are a model's, not measured training

    def __init__(self, comm: Any, *, step_s: float, per_token_s: float) -> None:
        self.comm, self.step_s, self.per_token_s = comm, step_s, per_token_s
        self.world = comm.Get_size() if comm is not None else 1
        self.step = 0
        self.policy_version = 0

    def modelled_seconds(self, batch: TrainBatch) -> float:
        """The step time of `batch`: every token trained once, the tokens split over the trainer ranks."""
        return self.step_s + self.per_token_s * int(batch.lengths.sum()) / self.world

    def train_step(self, batch: TrainBatch) -> StepMetrics:
        start = time.perf_counter()
        time.sleep(self.modelled_seconds(batch))
        if self.comm is not None and self.world > 1:
            self.comm.allreduce(0)  # where a trainer all-reduces gradients: every rank ends the step together
        staleness = (self.policy_version - batch.versions).clamp(min=0) * batch.generated
        generated = int(batch.generated.sum())
        self.step += 1
        self.policy_version += 1
        return StepMetrics(step=self.step, policy_version=self.policy_version, loss=0.0, mean_ratio=1.0,
                           clip_fraction=0.0, truncated_fraction=0.0,
                           mean_staleness=float(staleness.sum()) / max(generated, 1),
                           max_staleness=int(staleness.max()) if generated else 0, kl=0.0, grad_norm=0.0,
                           reward_mean=float(batch.rewards.mean()) if batch.size else 0.0, tokens=generated,
                           sequences=int(batch.size), seconds=time.perf_counter() - start)

    def named_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        yield WEIGHT_NAME, torch.full((16,), float(self.policy_version), dtype=dtype or torch.float32)

    update_weights = named_weights  # a weight update sends every weight

    def save_checkpoint(self, path: str | Path) -> Path:
        path = Path(path)
        if self.comm is None or self.comm.Get_rank() == 0:
            partial = path.with_name(path.name + ".partial")
            partial.write_text(json.dumps({"backend": "timing", "step": self.step,
                                           "policy_version": self.policy_version}))
            os.replace(partial, path)
        if self.comm is not None:
            self.comm.Barrier()  # nobody reads it back before it is in place
        return path

    def load_checkpoint(self, path: str | Path) -> None:
        state = json.loads(Path(path).read_text())
        self.step, self.policy_version = int(state["step"]), int(state["policy_version"])
