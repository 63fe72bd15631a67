"""``sfhpc attach``: a Slurm job of its own whose rollout workers join a running run (`sfhpc.rl.attached`).

Capacity that frees up while a run goes on (a backfill window, a preemptible QOS, nodes back from maintenance)
joins it without touching the run's job: the attach job's tasks are `python -m sfhpc.rank.attached RUN` (one
worker per task, one GPU each where the pool has GPUs), outside the run's MPI world. The job is requeueable:
Slurm's preemption and ``scontrol requeue`` send its workers TERM (they hand their episodes back and leave at
once) and its next start joins the run again; the time limit's warning comes ``launch.signal_grace_s`` ahead as
USR1 to every task (``--signal=USR1@N``: the workers, not the batch shell) and does the same; ``scancel`` ends it.

`attach_spec` is pure, like `sfhpc.launch.sbatch.render_sbatch` that renders it (golden files); `pool_for`
picks the pool from the cluster map: one whose tags include the recipe's rollout tags, the one on `--partition`
where given.
"""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
import sys
from pathlib import Path

from sfhpc.config.cluster import ClusterMap, Pool
from sfhpc.config.recipe import Recipe
from sfhpc.errors import SfhpcError
from sfhpc.launch.sbatch import FlagValue, SbatchSpec

WORKER_MODULE = "sfhpc.rank.attached"


@dataclasses.dataclass(frozen=True)
class AttachRequest:
    """What ``sfhpc attach`` (or a recipe's ``attach`` section) asks for."""

    workers: int
    partition: str | None = None
    qos: str | None = None
    time_minutes: int | None = None  # None: the recipe's launch.time_minutes
    after: str | None = None  # a job id: start once that job has started (the run's own, from sfhpc launch)

    @classmethod
    def of(cls, recipe: Recipe, after: str) -> AttachRequest:
        """A recipe's ``attach`` section, submitted with the run's job `after`."""
        spec = recipe.attach
        assert spec is not None
        return cls(spec.rollout, spec.partition, spec.qos, spec.time_minutes, after)


def pool_for(recipe: Recipe, cluster: ClusterMap, partition: str | None) -> Pool:
    """The pool the workers run on: the run's rollout ranks' (as the map places the recipe), or, on `partition`,
    the first pool there (in the map's order) whose tags include every tag the recipe's rollout role asks for."""
    if partition is None:
        from sfhpc.plan.resolve import resolve

        placed = [c.pool for c in resolve(recipe, cluster).components if "rollout" in c.roles]
        if placed:
            return placed[-1]  # (the last: a seamless run's trainer component may also hold rollout ranks)
    role = recipe.role("rollout")
    wanted = set(role.tags) if role is not None else {"rollout"}
    for pool in cluster.pools:
        if wanted <= set(pool.tags) and partition in (None, pool.partition):
            return pool
    where = f"on partition '{partition}' " if partition else ""
    raise SfhpcError(f"no pool {where}of cluster '{cluster.cluster}' offers the rollout role's tags "
                     f"{sorted(wanted)} (sfhpc tags show lists the pools)")


def attach_spec(recipe: Recipe, pool: Pool, request: AttachRequest, run_dir: str, *, python: str,
                output: str) -> SbatchSpec:
    """The batch script of an attach job for the run in `run_dir` (`python`: shell words)."""
    if request.workers < 1:
        raise SfhpcError(f"--rollout {request.workers}: an attach job needs at least one worker")
    launch = recipe.launch
    role = recipe.role("rollout")
    flags: dict[str, FlagValue] = {
        "job_name": f"sfhpc-attach-{recipe.name}",
        "partition": pool.partition,
        "constraint": pool.constraint,
        "ntasks": request.workers,
        "cpus_per_task": role.cpus_per_task if role is not None else 1,
        "gpus_per_task": 1 if pool.gpus_per_node else None,
        "time": request.time_minutes or launch.time_minutes,
        "account": launch.account,
        "qos": request.qos or launch.qos,
        "output": output,
        "open_mode": "append",
        "requeue": True,  # preempted or requeued: its next start joins the run again
        "signal": f"USR1@{launch.signal_grace_s}",  # every task, ahead of the time limit: the workers leave
        "dependency": None if request.after is None else f"after:{request.after}",
    }
    tags = ",".join(pool.tags)
    command = " ".join((python, "-u", "-m", WORKER_MODULE, shlex.quote(run_dir), "--tags", shlex.quote(tags)))
    return SbatchSpec(
        components=(flags,),
        command=command,
        # A worker that fails ends only itself: the others, and the run, go on.
        srun_flags={"mpi": "none", "label": True, "kill_on_bad_exit": 0},
        extra_directives=launch.extra_sbatch,
        setup=launch.setup,
        header=(f"sfhpc attach job: {request.workers} rollout worker(s) on pool '{pool.name}' for the run in "
                f"{run_dir}",),
        step_note="one step, outside the run's MPI world: each worker joins the run and leaves it on its own",
    )


def submit_attach(recipe: Recipe, cluster: ClusterMap, request: AttachRequest, run_dir: Path, *,
                  dry_run: bool = False) -> tuple[str, Pool]:
    """Submit the attach job of `request` for the run in `run_dir` (recorded in the job index); returns its id
    (with `dry_run`: the batch script instead, unsubmitted) and the pool it runs on."""
    from sfhpc.launch.sbatch import render_sbatch
    from sfhpc.rundir import RunPaths, record_job

    pool = pool_for(recipe, cluster, request.partition)
    script = render_sbatch(attach_spec(recipe, pool, request, str(run_dir), python=shlex.quote(sys.executable),
                                       output=str(RunPaths(run_dir).logs / "attach-%j.out")))
    if dry_run:
        return script, pool
    job = submit_script(script)
    record_job(recipe.output_dir, job, run_dir, recipe.source)
    return job, pool


def submit_script(script: str) -> str:
    """Submit a batch script with sbatch; returns the job id."""
    try:
        done = subprocess.run(["sbatch", "--parsable"], input=script, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise SfhpcError("sbatch is not on PATH: attach from a node that submits Slurm jobs") from None
    if done.returncode != 0:
        raise SfhpcError(f"sbatch refused the attach job: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip().split(";")[0]
