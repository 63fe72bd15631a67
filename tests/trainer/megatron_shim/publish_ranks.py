"""Rank program of the trainer-worker mpiexec test (CPU, megatron through the shim):

    mpiexec -n 4 python -m tests.trainer.megatron_shim.publish_ranks RECIPES_DIR OUT_DIR LAYOUT [LAYOUT ...]

For each ``RECIPES_DIR/<LAYOUT>.yaml`` (two trainer ranks, one rollout rank) the ranks take the places the
recipe gives them on the real communicators of a run: world rank 0 stands in for the controller and sends
the trainers one step's commands as the controller does (the batch to the first trainer only), the
trainer ranks serve them with `TrainerWorker`, and the rollout rank receives the published weights over the
weight-broadcast group as its engine would. Written to ``OUT_DIR/<LAYOUT>/``: ``received.json`` (what the
rollout rank got), ``trainer<r>.json`` (each trainer's full weights after the step, and its metrics) and,
from world rank 0, ``single.json``: one trainer of the same recipe alone on the same batch.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any


def _values(named: Any) -> dict[str, list[float]]:
    return {n: t.detach().float().flatten().tolist() for n, t in named}


def main() -> int:
    import torch
    from mpi4py import MPI

    from sfhpc.config.recipe import load_recipe
    from sfhpc.plan.local_map import local_cluster_map
    from sfhpc.plan.resolve import resolve
    from sfhpc.rl import messages as msg
    from sfhpc.rl.trainer_worker import TrainerWorker, build_trainer
    from sfhpc.runtime.comm_layout import build_comm_layout
    from tests.trainer.conftest import toy_batch

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    me = world.Get_rank()
    recipes, out = Path(sys.argv[1]), Path(sys.argv[2])
    batch = toy_batch(rows=8, seed=3)
    for name in sys.argv[3:]:
        recipe = load_recipe(recipes / f"{name}.yaml")
        layout = build_comm_layout(world, resolve(recipe, local_cluster_map(recipe)))
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        model_dir = Path(recipe.model.path or "")
        dtype = getattr(torch, recipe.model.dtype)
        if me == layout.controller_rank:
            trainers = layout.trainer_ranks
            msg.send(world, msg.Train(1, batch), trainers[0])
            for rank in trainers[1:]:
                msg.send(world, msg.Train(1, None), rank)
            trained = msg.receive(world, trainers[0], msg.REPLY_TAG)
            for rank in trainers:
                msg.send(world, msg.SyncWeights(trained.version), rank)
            msg.receive(world, trainers[0], msg.REPLY_TAG)
            if recipe.training.backend == "torch":
                alone = build_trainer(recipe, dataclasses.replace(layout, trainers=MPI.COMM_SELF), model_dir)
                metrics = alone.train_step(batch).as_dict()
                (folder / "single.json").write_text(json.dumps(
                    {"metrics": metrics, "weights": _values(alone.named_weights(dtype=dtype))}))
        elif me in layout.trainer_ranks:
            worker = TrainerWorker(recipe, layout, build_trainer(recipe, layout, model_dir))
            worker.open_weight_stream()
            for _ in range(2):  # the step, then the weight update, as the controller sent them
                command = msg.receive(world, layout.controller_rank)
                reply = worker.train(command) if isinstance(command, msg.Train) else worker.publish(command)
                if reply is not None:  # the first trainer answers, as the rank's command loop sends it
                    msg.send(world, reply, layout.controller_rank, msg.REPLY_TAG)
            weights = _values(worker.trainer.named_weights(dtype=dtype))  # collective on every trainer rank
            (folder / f"trainer{layout.trainers.Get_rank()}.json").write_text(json.dumps(
                {"version": worker.trainer.policy_version, "weights": weights}))
            if worker.publisher is not None:
                worker.publisher.finish()
            if recipe.training.backend == "megatron":
                from megatron.core import parallel_state

                del worker
                parallel_state.destroy_model_parallel()  # the next layout builds its own groups
        else:
            from sfhpc.weights.publisher import WeightReceiver
            from sfhpc.weights.transport import connect

            receiver = WeightReceiver(connect(layout.weight_broadcast, recipe.engine.weight_transport))
            incoming = receiver.receive()
            assert incoming is not None
            received: dict[str, list[float]] = {}
            for bucket in incoming:
                received.update(_values(bucket))
            assert receiver.receive() is None  # the stream ends with the publisher's finish
            (folder / "received.json").write_text(json.dumps({"version": incoming.version, "weights": received}))
        world.Barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
