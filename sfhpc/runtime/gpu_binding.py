"""One GPU per rank: which of its node's GPUs a rank uses, when Slurm has not bound it to one already.

A component whose every task uses GPUs asks Slurm for ``--gpus-per-task`` and ``--gpu-bind=single:1``
(`sfhpc.launch.sbatch`), and each task then sees its own GPU only. A component that also holds ranks
without a GPU (the controller placed with the trainers) cannot: Slurm gives one GPU count to every task of a
component, so it asks for ``--gpus-per-node`` and every task sees all the node's GPUs. Then the rank picks
its own here, before CUDA starts: the GPU ranks of a node take its GPUs in the order of their local task
ids, after the GPU-less ranks placed first on the component's first node.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from sfhpc.errors import SfhpcError
from sfhpc.plan.launch_plan import Component
from sfhpc.runtime.slurm_env import RankEnvironment

VISIBLE = "CUDA_VISIBLE_DEVICES"


def gpu_rank_on_node(component: Component, env: RankEnvironment) -> int | None:
    """This rank's number among the GPU ranks of its node, or None for a rank without a GPU."""
    if component.gpus_per_node == 0:
        return None
    owner = component.task_roles[-1]  # the role that owns the nodes (and its colocated roles) comes last
    riders = sum(1 for roles in component.task_roles if roles != owner)  # placed ranks: first, no GPU
    if env.task_in_component < riders:
        return None
    # Slurm places a component's tasks block by block: on the first node task and local ids coincide, and
    # the riders there come first.
    on_first_node = env.task_in_component == env.local_rank
    return env.local_rank - riders if on_first_node else env.local_rank


def visible_device(component: Component, env: RankEnvironment, visible: str | None) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` this rank should run with, or None to leave it as it is: Slurm bound it
    to one GPU already, the rank uses none, or the job was not started by Slurm."""
    index = gpu_rank_on_node(component, env)
    if env.launcher != "slurm" or index is None:
        return None
    devices = [d for d in (visible or "").split(",") if d]
    if len(devices) == 1:
        return None  # bound by Slurm
    if not devices:
        return str(index)  # GPUs Slurm does not manage as gres: the node's own numbering
    if index >= len(devices):
        raise SfhpcError(f"rank {env.world_rank} is GPU rank {index} of node {env.node}, which shows only "
                         f"{len(devices)} GPU(s) ({VISIBLE}={visible}); ask for fewer tasks per node")
    return devices[index]


def bind_one_gpu(component: Component, env: RankEnvironment,
                 environ: MutableMapping[str, str] | None = None) -> str | None:
    """Narrow ``CUDA_VISIBLE_DEVICES`` to this rank's GPU when Slurm did not (call before CUDA starts);
    returns the value set, or None when nothing changed."""
    environ = os.environ if environ is None else environ
    device = visible_device(component, env, environ.get(VISIBLE))
    if device is not None:
        environ[VISIBLE] = device
    return device
