"""One GPU per rank on the GPU site's map (recipes/cluster-h100-l40s.yaml): the rollout component, GPU ranks
only, asks Slurm for a GPU per task bound to it; the trainer component, which also holds the controller,
asks for the node's GPUs and each trainer rank narrows CUDA_VISIBLE_DEVICES to its own at start, from its
Slurm local id (read as Slurm gives it, through `sfhpc.runtime.slurm_env`). No GPU exists here: the
inputs are what Slurm would hand each rank."""

from __future__ import annotations

import pytest

from sfhpc.config import load_cluster_map, load_recipe
from sfhpc.errors import SfhpcError
from sfhpc.launch.sbatch import component_flags
from sfhpc.plan.launch_plan import LaunchPlan
from sfhpc.plan.resolve import resolve
from sfhpc.runtime.gpu_binding import bind_one_gpu, visible_device
from sfhpc.runtime.slurm_env import read_rank_environment
from tests.conftest import RECIPES

ALL_EIGHT = "0,1,2,3,4,5,6,7"


@pytest.fixture(scope="module")
def plan() -> LaunchPlan:
    return resolve(load_recipe(RECIPES / "h100-l40s-grpo.yaml"), load_cluster_map(RECIPES / "cluster-h100-l40s.yaml"))


def _slurm(plan: LaunchPlan, rank: int, local_id: int) -> dict[str, str]:
    counts = plan.tasks_per_component
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(sum(counts)),
           "SLURM_LOCALID": str(local_id), "SLURM_HET_SIZE": str(len(counts))}
    env.update({f"SLURM_NTASKS_HET_GROUP_{k}": str(n) for k, n in enumerate(counts)})
    return env


def _device(plan: LaunchPlan, rank: int, local_id: int, visible: str | None) -> str | None:
    env = read_rank_environment(_slurm(plan, rank, local_id))
    return visible_device(plan.components[env.component], env, visible)


def test_sbatch_asks_one_bound_gpu_per_task_where_every_task_uses_one(plan: LaunchPlan) -> None:
    trainers, rollouts = (component_flags(c, 60) for c in plan.components)
    assert plan.components[0].roles == ("controller", "trainer")
    # The controller shares the trainers' component: Slurm cannot give it no GPU and them one each.
    assert trainers["gpus_per_node"] == 8 and "gpus_per_task" not in trainers and "gpu_bind" not in trainers
    assert rollouts["gpus_per_task"] == 1 and rollouts["gpu_bind"] == "single:1" and "gpus_per_node" not in rollouts


def test_cpu_components_ask_for_no_gpus() -> None:
    dev = resolve(load_recipe(RECIPES / "report.yaml"), load_cluster_map(RECIPES / "cluster-dev.yaml"))
    for component in dev.components:
        assert not {"gpus_per_node", "gpus_per_task", "gpu_bind"} & set(component_flags(component, 60))


def test_trainer_ranks_take_their_own_gpu_after_the_controller(plan: LaunchPlan) -> None:
    assert _device(plan, 0, 0, ALL_EIGHT) is None  # the controller: no GPU
    # Node 0 holds the controller (local id 0) and trainers 1..8; they take GPUs 0..7.
    assert [_device(plan, r, r, ALL_EIGHT) for r in range(1, 9)] == [str(g) for g in range(8)]
    # Node 1: trainer tasks 9..16 with local ids 0..7.
    assert [_device(plan, 9 + i, i, ALL_EIGHT) for i in range(8)] == [str(g) for g in range(8)]
    # The node's own numbering is what Slurm showed, not 0..N-1.
    assert _device(plan, 2, 2, "4,5,6,7,0,1,2,3") == "5"


def test_slurm_bound_ranks_are_left_alone(plan: LaunchPlan) -> None:
    rollout = plan.world_size - 1
    assert _device(plan, rollout, 3, "2") is None  # --gpus-per-task with --gpu-bind: already its own
    assert _device(plan, 1, 1, "6") is None


def test_without_gres_the_local_id_picks_the_gpu(plan: LaunchPlan) -> None:
    assert _device(plan, 3, 3, None) == "2"
    environ = {"CUDA_VISIBLE_DEVICES": ALL_EIGHT}
    env = read_rank_environment(_slurm(plan, 4, 4))
    assert bind_one_gpu(plan.components[env.component], env, environ) == "3"
    assert environ["CUDA_VISIBLE_DEVICES"] == "3"


def test_more_gpu_ranks_than_visible_gpus_is_one_clear_error(plan: LaunchPlan) -> None:
    with pytest.raises(SfhpcError, match=r"GPU rank 7 of node .* shows only 4 GPU\(s\)"):
        _device(plan, 8, 8, "0,1,2,3")


def test_ranks_started_by_mpiexec_keep_their_devices(plan: LaunchPlan) -> None:
    env = read_rank_environment({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "65",
                                 "OMPI_COMM_WORLD_LOCAL_RANK": "1", "SFHPC_TASKS_PER_COMPONENT": "33,32"})
    assert visible_device(plan.components[env.component], env, ALL_EIGHT) is None
