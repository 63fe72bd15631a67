"""The one place that reads the launcher's environment (every ``SLURM_*`` read lives here).

Inside a heterogeneous step Slurm numbers tasks 0..N-1 across all components (``SLURM_PROCID``) and
gives each component's task count in ``SLURM_NTASKS_HET_GROUP_k``. A task's component is found from
its ``SLURM_PROCID`` and the running sums of those counts. ``SLURM_JOB_PARTITION`` is *not* used: inside
a het step it is unreliable (ranks of one component can see another component's partition).

Without Slurm, ``sfhpc run`` starts ranks with Open MPI's ``mpiexec`` and passes the tasks per
component in ``SFHPC_TASKS_PER_COMPONENT`` (for example ``2,2``); ranks come from ``OMPI_COMM_WORLD_*``.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from typing import Literal

from sfhpc.errors import SfhpcError

TASKS_PER_COMPONENT_VAR = "SFHPC_TASKS_PER_COMPONENT"
# Set by a launcher that printed the plan on the console itself (`sfhpc run`): rank 0 does not print it again.
PLAN_SHOWN_VAR = "SFHPC_PLAN_SHOWN"


@dataclasses.dataclass(frozen=True)
class RankEnvironment:
    """Where this process sits in the job, as the launcher tells it."""

    launcher: Literal["slurm", "mpiexec", "single"]
    world_rank: int
    world_size: int
    local_rank: int
    node: str
    component: int
    task_in_component: int
    tasks_per_component: tuple[int, ...]
    job_id: str | None = None
    restart_count: int = 0
    partitions: tuple[str, ...] = ()   # per component, from SLURM_JOB_PARTITION_HET_GROUP_k (reliable)


def _int(env: Mapping[str, str], name: str) -> int:
    value = env.get(name)
    if value is None:
        raise SfhpcError(f"environment variable {name} is not set: is this process started by srun or mpiexec?")
    try:
        return int(value)
    except ValueError:
        raise SfhpcError(f"environment variable {name}={value!r} is not an integer") from None


def _component_of(rank: int, tasks_per_component: tuple[int, ...]) -> tuple[int, int]:
    first = 0
    for index, count in enumerate(tasks_per_component):
        if rank < first + count:
            return index, rank - first
        first += count
    raise SfhpcError(f"rank {rank} lies outside the job's {sum(tasks_per_component)} tasks {tasks_per_component}")


def _parse_counts(text: str, name: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise SfhpcError(f"{name}={text!r} must be a comma-separated list of task counts") from None
    if not counts or min(counts) < 1:
        raise SfhpcError(f"{name}={text!r} must list at least one positive task count")
    return counts


def read_rank_environment(env: Mapping[str, str] | None = None) -> RankEnvironment:
    """Read this process's place in the job from `env` (default: os.environ)."""
    env = os.environ if env is None else env
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return _from_slurm(env)
    if "OMPI_COMM_WORLD_RANK" in env:
        return _from_mpiexec(env)
    return RankEnvironment("single", 0, 1, 0, socket.gethostname(), 0, 0, (1,))


def _from_slurm(env: Mapping[str, str]) -> RankEnvironment:
    rank, size = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    if "SLURM_HET_SIZE" in env:
        groups = _int(env, "SLURM_HET_SIZE")
        counts = tuple(_int(env, f"SLURM_NTASKS_HET_GROUP_{k}") for k in range(groups))
        partitions = tuple(env.get(f"SLURM_JOB_PARTITION_HET_GROUP_{k}", "") for k in range(groups))
    else:
        counts, partitions = (size,), (env.get("SLURM_JOB_PARTITION", ""),)
    world = next((k for k in range(1, len(counts) + 1) if sum(counts[:k]) == size), None)
    if world is not None:
        # A step over the first components only (agent hosts, the last component, run a step of their own):
        # the counts describe the whole job, the world is their prefix.
        counts, partitions = counts[:world], partitions[:world]
    else:
        # A step that spans only some components: the counts then describe the whole job, not the step.
        raise SfhpcError(f"this job step has {size} tasks but the job's components hold {counts}: "
                         "start the step with srun --het-group covering every component")
    component, task = _component_of(rank, counts)
    return RankEnvironment(
        launcher="slurm",
        world_rank=rank,
        world_size=size,
        local_rank=_int(env, "SLURM_LOCALID"),
        node=env.get("SLURMD_NODENAME") or socket.gethostname(),
        component=component,
        task_in_component=task,
        tasks_per_component=counts,
        job_id=current_job_id(env),
        restart_count=restart_count(env),
        partitions=partitions,
    )


def _from_mpiexec(env: Mapping[str, str]) -> RankEnvironment:
    rank, size = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
    counts_text = env.get(TASKS_PER_COMPONENT_VAR)
    counts = _parse_counts(counts_text, TASKS_PER_COMPONENT_VAR) if counts_text else (size,)
    if sum(counts) != size:
        raise SfhpcError(f"{TASKS_PER_COMPONENT_VAR}={counts_text} adds up to {sum(counts)} ranks, "
                         f"but mpiexec started {size}")
    component, task = _component_of(rank, counts)
    return RankEnvironment(
        launcher="mpiexec",
        world_rank=rank,
        world_size=size,
        local_rank=int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")),
        node=socket.gethostname(),
        component=component,
        task_in_component=task,
        tasks_per_component=counts,
    )


def in_multi_task_step(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is one task of a Slurm job step with more than one task (an srun'd MPI world)."""
    env = os.environ if env is None else env
    try:
        tasks = int(env.get("SLURM_NTASKS", "1") or 1)
    except ValueError:
        return False
    return tasks > 1 and "SLURM_STEP_ID" in env


def current_job_id(env: Mapping[str, str] | None = None) -> str | None:
    """The Slurm job id of this process (the het leader's id inside a het step), if any."""
    return (os.environ if env is None else env).get("SLURM_JOB_ID") or None


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How often Slurm has requeued this job before the current run (0 on its first run, and outside Slurm)."""
    text = (os.environ if env is None else env).get("SLURM_RESTART_COUNT") or "0"
    try:
        return int(text)
    except ValueError:
        raise SfhpcError(f"environment variable SLURM_RESTART_COUNT={text!r} is not an integer") from None
