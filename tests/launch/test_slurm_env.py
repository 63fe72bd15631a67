"""Rank identity from the launcher's environment (het steps, mpiexec) and its match with the plan."""

from __future__ import annotations

import pytest

from sfhpc.config import load_cluster_map, load_recipe
from sfhpc.errors import SfhpcError
from sfhpc.plan.resolve import resolve
from sfhpc.runtime.identity import identify
from sfhpc.runtime.slurm_env import current_job_id, in_multi_task_step, read_rank_environment, restart_count
from tests.conftest import RECIPES

HET_STEP = {
    "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "41", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
    "SLURMD_NODENAME": "n4", "SLURM_HET_SIZE": "2", "SLURM_NTASKS_HET_GROUP_0": "2",
    "SLURM_NTASKS_HET_GROUP_1": "2", "SLURM_JOB_PARTITION_HET_GROUP_0": "train",
    "SLURM_JOB_PARTITION_HET_GROUP_1": "rollout", "SLURM_RESTART_COUNT": "1",
    # Inside het steps this variable can name another component's partition: it must not be used.
    "SLURM_JOB_PARTITION": "train",
}


@pytest.mark.parametrize(("procid", "component", "task"), [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)])
def test_component_comes_from_procid_and_group_sizes(procid: int, component: int, task: int) -> None:
    env = read_rank_environment({**HET_STEP, "SLURM_PROCID": str(procid)})
    assert (env.launcher, env.world_rank, env.world_size) == ("slurm", procid, 4)
    assert (env.component, env.task_in_component) == (component, task)
    assert env.tasks_per_component == (2, 2) and env.partitions == ("train", "rollout")
    assert (env.job_id, env.restart_count, env.node, env.local_rank) == ("41", 1, "n4", 1)


def test_plain_job_step_is_one_component() -> None:
    env = read_rank_environment({"SLURM_STEP_ID": "0", "SLURM_PROCID": "2", "SLURM_NTASKS": "3",
                                 "SLURM_LOCALID": "0", "SLURMD_NODENAME": "n2", "SLURM_JOB_PARTITION": "train"})
    assert (env.component, env.task_in_component, env.tasks_per_component) == (0, 2, (3,))


def test_mpiexec_ranks_use_the_local_layout() -> None:
    env = read_rank_environment({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                                 "OMPI_COMM_WORLD_LOCAL_RANK": "3", "SFHPC_TASKS_PER_COMPONENT": "1,3"})
    assert (env.launcher, env.component, env.task_in_component) == ("mpiexec", 1, 2)
    with pytest.raises(SfhpcError, match="adds up to 5 ranks, but mpiexec started 4"):
        read_rank_environment({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
                               "SFHPC_TASKS_PER_COMPONENT": "2,3"})


def test_step_over_part_of_a_het_job_is_refused() -> None:
    with pytest.raises(SfhpcError, match="--het-group covering every component"):
        read_rank_environment({**HET_STEP, "SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_NTASKS_HET_GROUP_1": "3"})


def test_a_step_over_the_first_components_leaves_out_the_agent_hosts() -> None:
    """Agent hosts, the last component, run a step of their own: the ranks' step spans the others."""
    env = read_rank_environment({**HET_STEP, "SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURM_HET_SIZE": "3",
                                 "SLURM_NTASKS_HET_GROUP_1": "1", "SLURM_NTASKS_HET_GROUP_2": "2",
                                 "SLURM_JOB_PARTITION_HET_GROUP_2": "cpu"})
    assert (env.component, env.task_in_component, env.tasks_per_component) == (1, 0, (2, 1))
    assert env.partitions == ("train", "rollout")


def test_identity_joins_environment_and_plan() -> None:
    plan = resolve(load_recipe(RECIPES / "report.yaml"), load_cluster_map(RECIPES / "cluster-dev.yaml"))
    identity = identify(plan, read_rank_environment({**HET_STEP, "SLURM_PROCID": "2"}))
    assert identity.roles == ("rollout",) and identity.tags == ("rollout", "reward", "cpu")
    assert identity.as_record()["component"] == 1 and identity.as_record()["node"] == "n4"
    colocated = resolve(load_recipe(RECIPES / "report-colocated.yaml"),
                        load_cluster_map(RECIPES / "cluster-dev.yaml"))
    shape = r"this job has 2 component\(s\) with tasks \[2, 2\].*needs 1 with tasks \[3\]"
    with pytest.raises(SfhpcError, match=shape):
        identify(colocated, read_rank_environment({**HET_STEP, "SLURM_PROCID": "0"}))


def test_job_id_and_restart_count_helpers() -> None:
    assert current_job_id({}) is None and current_job_id({"SLURM_JOB_ID": ""}) is None
    assert current_job_id({"SLURM_JOB_ID": "41"}) == "41"
    assert restart_count({}) == 0 and restart_count({"SLURM_RESTART_COUNT": ""}) == 0
    assert restart_count({"SLURM_RESTART_COUNT": "2"}) == 2
    with pytest.raises(SfhpcError, match="SLURM_RESTART_COUNT='x' is not an integer"):
        restart_count({"SLURM_RESTART_COUNT": "x"})


def test_a_multi_task_step_is_recognised_from_its_environment() -> None:
    assert in_multi_task_step({"SLURM_NTASKS": "3", "SLURM_STEP_ID": "0"})
    assert not in_multi_task_step({"SLURM_NTASKS": "1", "SLURM_STEP_ID": "0"})  # a one-task step
    assert not in_multi_task_step({"SLURM_NTASKS": "3"})  # the batch script, outside any step
    assert not in_multi_task_step({"SLURM_NTASKS": "three", "SLURM_STEP_ID": "0"})
