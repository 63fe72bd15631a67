"""Rank program of the DDP test: `mpiexec -n 2 python -m tests.trainer.ddp_ranks MODEL_DIR OUT_DIR`.

Both ranks train on the same global batches (each takes its half of the rows); each writes its weights
digest, and rank 0 also trains a single-process trainer on the same batches for comparison.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    import torch
    from mpi4py import MPI

    from sfhpc.config.recipe import AlgorithmSpec
    from sfhpc.trainer.distributed import DistSpec
    from sfhpc.trainer.torch_trainer import TorchTrainer
    from tests.trainer.conftest import toy_batch

    torch.set_num_threads(1)
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    comm = MPI.COMM_WORLD.Split(0, MPI.COMM_WORLD.Get_rank())  # a sub-communicator, as the runtime gives
    spec = DistSpec.from_mpi(comm, host="127.0.0.1")
    config = AlgorithmSpec(learning_rate=1e-3)
    batches = [toy_batch(rows=8, seed=s) for s in range(3)]
    trainer = TorchTrainer(model_dir, config, dist=spec)
    metrics = [trainer.train_step(b).as_dict() for b in batches]
    trainer.save_checkpoint(out / "ddp.pt")
    result = {"rank": spec.rank, "world": spec.world_size, "metrics": metrics,
              "weights": {n: t.flatten().tolist() for n, t in trainer.named_weights()}}
    if spec.rank == 0:
        single = TorchTrainer(model_dir, config)
        result["single_metrics"] = [single.train_step(b).as_dict() for b in batches]
        result["single_weights"] = {n: t.flatten().tolist() for n, t in single.named_weights()}
    (out / f"rank{spec.rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
