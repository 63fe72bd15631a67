"""A trainer rank: trains on the batches the controller sends and publishes the new weights.

Trainer ranks run data parallel (DDP over gloo on the trainers communicator): every rank receives the
same commands, and the batch of a step reaches the first trainer, which broadcasts it to the others. The
first trainer answers for all of them and is the root of the weight broadcast to the rollout ranks; under
megatron's tensor or pipeline parallelism the ranks of its model-parallel group assemble those weights
with it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from sfhpc.config.recipe import Recipe
from sfhpc.rl import messages as msg
from sfhpc.runtime import fault_injection
from sfhpc.runtime.comm_layout import CommLayout
from sfhpc.weights.publisher import WeightPublisher


def build_trainer(recipe: Recipe, layout: CommLayout, model_dir: Path, resume_from: Path | None = None) -> Any:
    """The recipe's training backend over the trainers communicator (collective on the trainer ranks),
    restored from the trainer state file `resume_from` when the run continues from a checkpoint."""
    from sfhpc.trainer.distributed import DistSpec

    if recipe.training.backend == "timing":  # a timing model (benchmarks): sleeps the modelled step
        from sfhpc.trainer.timing_trainer import TimingTrainer

        trainer: Any = TimingTrainer(layout.trainers, step_s=recipe.timing_model.train_step_s,
                                     per_token_s=recipe.timing_model.train_per_token_s)
        if resume_from is not None:
            trainer.load_checkpoint(resume_from)
        return trainer
    import torch

    # The rank's own GPU where it has one (the runtime narrowed CUDA_VISIBLE_DEVICES to it), else the CPU.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist = DistSpec.from_mpi(layout.trainers, backend="nccl" if device == "cuda" else "gloo")
    if recipe.training.backend == "megatron":
        from sfhpc.trainer.megatron_backend import MegatronTrainer

        trainer = MegatronTrainer.from_recipe(recipe, model_dir, dist=dist)
    else:
        from sfhpc.trainer.torch_trainer import TorchTrainer

        trainer = TorchTrainer(model_dir, recipe.algorithm, dist=dist, seed=recipe.seed, device=device,
                               training=recipe.training, lora_spec=recipe.model.lora)
    if resume_from is not None:
        trainer.load_checkpoint(resume_from)
    return trainer


class TrainerWorker:
    def __init__(self, recipe: Recipe, layout: CommLayout, trainer: Any, *, attach: Path | None = None) -> None:
        """`attach`: the run folder's register where the first trainer's weight server is written, for rollout
        workers of other jobs (`sfhpc.weights.version_server`); None where the run takes none."""
        self.recipe, self.layout, self.trainer, self.attach = recipe, layout, trainer, attach
        self.rank = layout.world.Get_rank()
        assert layout.trainers is not None  # a trainer rank is in the trainers' communicator
        self.trainers = layout.trainers
        self.is_first = self.trainers.Get_rank() == 0
        self.publisher: WeightPublisher | None = None

    def open_weight_stream(self) -> None:
        """The first trainer opens the weight broadcast (collective with the engine ranks, which join once their
        engines are up): after this rank's own engine, if lent, has started, so the two start side by side."""
        layout = self.layout
        if layout.weight_broadcast is not None and self.rank == layout.weight_root:
            from sfhpc.weights.transport import connect

            self.publisher = WeightPublisher(connect(layout.weight_broadcast, self.recipe.engine.weight_transport),
                                             delta=self.recipe.engine.weight_delta)
            if self.attach is not None:
                from sfhpc.weights.version_server import VersionServer

                self.publisher.late = VersionServer(self.attach)

    def train(self, command: msg.Train) -> msg.Trained | None:
        if hold := fault_injection.hold_seconds("train"):
            time.sleep(hold)  # a test stretches the step to signal the job inside it
        fault_injection.strike("train", self.rank)  # a test makes the rank fail here
        batch = command.batch
        if self.trainers.Get_size() > 1:
            # Once over the trainers' communicator: the controller sent the batch to the first trainer only.
            batch = self.trainers.bcast(batch, root=0)
        if batch is None:
            raise RuntimeError(f"rank {self.rank}: step {command.step} came without a batch to train on")
        metrics = self.trainer.train_step(batch)
        # The first trainer answers for every trainer rank.
        return msg.Trained(command.step, self.trainer.policy_version, metrics.as_dict()) if self.is_first else None

    def publish(self, command: msg.SyncWeights) -> msg.Synced | None:
        start, sent = time.perf_counter(), 0
        if self.publisher is not None:
            import torch

            # float32 master weights are cast to the engines' dtype into staging first; rollout ranks keep
            # generating until the header that follows it arrives.
            sent = self.publisher.publish(self.trainer.update_weights(), command.version,
                                          dtype=getattr(torch, self.recipe.model.dtype)).wire_bytes
        elif self.gathers_published_weights:
            # Under tensor or pipeline parallelism the weight stream is collective over the root's
            # model-parallel group (shards gathered, stages broadcast): these ranks iterate it with the root
            # and drop what they get. The other data-parallel replicas hold copies and sit it out.
            for _ in self.trainer.update_weights():
                pass
        return msg.Synced(self.rank, command.version, time.perf_counter() - start, sent) if self.is_first else None

    @property
    def gathers_published_weights(self) -> bool:
        """This rank takes part in assembling the weights the root publishes: every rank of a sharded torch
        trainer, or a rank of the root's model-parallel group (megatron, tensor or pipeline parallel > 1;
        data-parallel replica 0)."""
        if getattr(self.trainer, "weights_are_sharded", False):
            return True  # the torch backend's shards: every trainer rank gathers each parameter with the root
        sizes = getattr(self.trainer, "sizes", None)  # the megatron backend's tensor x pipeline x data grid
        if sizes is None or sizes.tensor * sizes.pipeline == 1:
            return False
        return bool(self.trainer.dp_rank == 0)

    def checkpoint(self, command: msg.Checkpoint) -> msg.CheckpointWritten | None:
        Path(command.path).parent.mkdir(parents=True, exist_ok=True)
        self.trainer.save_checkpoint(Path(command.path))
        return msg.CheckpointWritten(self.rank, command.path, self.trainer.policy_version) if self.is_first else None

    def stop(self, _command: msg.Stop) -> None:
        if self.publisher is not None:
            self.publisher.finish()  # the rollout ranks take the stream's end before they stop

