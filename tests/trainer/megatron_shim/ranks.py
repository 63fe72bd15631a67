"""Rank program of the megatron mpiexec test (CPU, through the shim):

    mpiexec -n 2 python -m tests.trainer.megatron_shim.ranks MODEL_DIR OUT_DIR LAYOUT [LAYOUT ...]

A layout is ``TPxPP`` with optional training settings after a colon: ``1x1:bf16,recompute,whole``
(``training.precision: bf16``, ``activation_checkpointing: true``, ``sharding: none``; with two data-parallel
ranks the default shards the optimizer). For each layout in turn, every rank trains the same global batches
with megatron-core laid out as tensor x pipeline x data parallel (data = ranks / (TP x PP)), saves a
checkpoint, loads it into a second trainer and takes one more step with both (``resumed``: whether their
weights came out bit-identical), and writes its step metrics and the full weight stream it publishes in HF
names to ``OUT_DIR/<layout>/rank<r>.json`` (the layout's colon and commas as ``_``). Rank 0
also trains the torch backend on the same batches (``OUT_DIR/torch.json``) for comparison. One process
runs every layout, because starting megatron-core costs more than a step.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path


def main() -> int:
    import torch
    from mpi4py import MPI

    from tests.trainer.megatron_shim import activate

    activate()
    from megatron.core import parallel_state

    from sfhpc.config.recipe import AlgorithmSpec, TrainingSpec
    from sfhpc.trainer import megatron_backend
    from sfhpc.trainer.distributed import DistSpec
    from sfhpc.trainer.torch_trainer import TorchTrainer
    from tests.trainer.conftest import toy_batch

    torch.set_num_threads(1)
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    comm = MPI.COMM_WORLD.Split(0, MPI.COMM_WORLD.Get_rank())  # a sub-communicator, as the runtime gives
    spec = DistSpec.from_mpi(comm, host="127.0.0.1")
    config = AlgorithmSpec(learning_rate=1e-3)
    batches = [toy_batch(rows=8, seed=s) for s in range(2)]
    options = {"bf16": {"precision": "bf16"}, "recompute": {"activation_checkpointing": True},
               "whole": {"sharding": "none"}}
    for layout in sys.argv[3:]:
        grid, _, flags = layout.partition(":")
        tp, pp = (int(x) for x in grid.split("x"))
        training = TrainingSpec(backend="megatron", tensor_parallel=tp, pipeline_parallel=pp,
                                **{k: v for flag in filter(None, flags.split(",")) for k, v in options[flag].items()})
        trainer = megatron_backend.MegatronTrainer(model_dir, config, training=training, dist=spec)
        metrics = [trainer.train_step(b).as_dict() for b in batches]
        folder = out / layout.replace(":", "_").replace(",", "_")
        folder.mkdir(exist_ok=True)
        trainer.save_checkpoint(folder / "megatron.pt")
        result = {"sizes": [trainer.sizes.tensor, trainer.sizes.pipeline, trainer.sizes.data], "metrics": metrics,
                  "memory": dataclasses.asdict(trainer.memory),
                  "weights": {n: t.flatten().tolist() for n, t in trainer.named_weights()}}
        resumed = megatron_backend.MegatronTrainer(model_dir, config, training=training, dist=spec)
        resumed.load_checkpoint(folder / "megatron.pt")
        after = [t.train_step(batches[0]) for t in (trainer, resumed)]
        result["resumed"] = after[0].loss == after[1].loss and all(
            torch.equal(a, b) for (_, a), (_, b) in zip(trainer.named_weights(), resumed.named_weights()))
        (folder / f"rank{spec.rank}.json").write_text(json.dumps(result))
        del trainer, resumed
        parallel_state.destroy_model_parallel()  # the next layout builds its own groups
    if spec.rank == 0:
        single = TorchTrainer(model_dir, config)
        result = {"metrics": [single.train_step(b).as_dict() for b in batches],
                  "weights": {n: t.flatten().tolist() for n, t in single.named_weights()}}
        (out / "torch.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
