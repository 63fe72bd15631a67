"""Submit a recipe to Slurm as one heterogeneous job, or render the script that would be submitted.

Two scripts come from the same plan and the same renderer:

* the *launch* script (``sfhpc launch``): submitit pickles a `RankProgram` into the run folder and every
  rank unpickles and runs it;
* the *template* script (``sfhpc render --template``, ``slurm_templates/``): every rank runs
  ``python -m sfhpc.rank "$@"``, so ``sbatch TEMPLATE RECIPE.yaml`` runs any recipe of that shape.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from pathlib import Path

from sfhpc.config.cluster import ClusterMap
from sfhpc.config.recipe import Recipe
from sfhpc.errors import SfhpcError
from sfhpc.launch.sbatch import SbatchSpec, double_quoted, render_sbatch, spec_for_plan
from sfhpc.launch.submitit_het import HetSlurmExecutor, HetSlurmJob
from sfhpc.plan.launch_plan import LaunchPlan
from sfhpc.rank.program import RankProgram
from sfhpc.rundir import RunPaths, record_job, record_recipe


@dataclasses.dataclass(frozen=True)
class Submission:
    job: HetSlurmJob
    run_dir: Path

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)


def _header(recipe: Recipe, cluster: ClusterMap, plan: LaunchPlan) -> tuple[str, ...]:
    return (f"sfhpc job for recipe '{recipe.name}' on cluster '{cluster.cluster}' ({plan.world_size} ranks)",
            *(f"component {c.index}: {c.pool.label} x{c.nodes}, roles {','.join(c.roles)}"
              + ("" if c.in_world else " (outside the MPI world)") for c in plan.components))


def launch_spec(recipe: Recipe, cluster: ClusterMap, plan: LaunchPlan, run_dir: Path, command: str,
                python: str) -> SbatchSpec:
    """The script of ``sfhpc launch``: every rank runs `command` (submitit's job entry point); the batch
    script runs the step guard with `python` (shell words)."""
    # submitit's job side finds its environment plugin through SUBMITIT_EXECUTOR.
    # The recipe as the user named it: the job runs in the folder it was submitted from.
    hosts = None if plan.agent_hosts is None else agent_hosts_command(
        python, shlex.quote(recipe.source), f"--run-dir {shlex.quote(str(run_dir))}")
    return spec_for_plan(plan, recipe, command, output=str(RunPaths(run_dir).slurm_log_pattern),
                         python=python, environment={"SUBMITIT_EXECUTOR": "slurm"},
                         header=_header(recipe, cluster, plan), agent_hosts=hosts)


def agent_hosts_command(python: str, *args: str) -> str:
    """What each task of the agents role runs (shell text): `args` are shell words already."""
    return " ".join((python, "-m", "sfhpc.rank.agent_host", *args))


def executor_for(recipe: Recipe, cluster: ClusterMap, plan: LaunchPlan, run_dir: Path) -> HetSlurmExecutor:
    def spec(command: str) -> SbatchSpec:
        return launch_spec(recipe, cluster, plan, run_dir, command, python=shlex.quote(sys.executable))

    return HetSlurmExecutor(RunPaths(run_dir).submitit, spec, num_tasks=plan.world_size)


def submit(recipe: Recipe, cluster: ClusterMap, plan: LaunchPlan, run_dir: Path, *, probe: bool = False) -> Submission:
    """Submit the job (`probe`: the launch report only); the run folder must exist (it holds the batch log
    from the first second)."""
    executor = executor_for(recipe, cluster, plan, run_dir)
    job = executor.submit_program(RankProgram(recipe, plan, run_dir, probe=probe))
    record_job(recipe.output_dir, str(job.job_id), run_dir, recipe.source)
    if not probe:  # what `sfhpc attach` and `sfhpc eval` read the run's recipe from
        record_recipe(run_dir, recipe.source, {})
    return Submission(job, run_dir)


def resumable_in_new_job(run_dir: Path, recipe: Recipe) -> Path:
    """The folder ``sfhpc launch --resume`` continues in a new job (absolute): a run of this recipe with a sound
    checkpoint (`check_resumable`), not complete (a job that would find nothing to do is not submitted), and
    that no job of the run may still write (two jobs would write one store); one line otherwise."""
    from sfhpc.launch.jobs import FINAL_STATES
    from sfhpc.rl.resume import check_resumable
    from sfhpc.rundir import jobs_of_run
    from sfhpc.runtime.slurm_job import live_job

    run_dir, latest = check_resumable(run_dir, recipe)
    if latest.step >= recipe.budgets.steps:
        raise SfhpcError(f"--resume {run_dir}: the run is complete (its checkpoint is of step {latest.step}, "
                         f"budgets.steps is {recipe.budgets.steps}); raise budgets.steps in {recipe.source} to "
                         "train on")
    for job_id in dict.fromkeys(jobs_of_run(Path(recipe.output_dir).absolute(), run_dir)
                                + jobs_of_run(run_dir.parent, run_dir)):
        live = live_job(job_id)
        if live is not None and live.state.split()[0] not in FINAL_STATES:
            raise SfhpcError(f"--resume {run_dir}: job {job_id} of this run is {live.state} and may still write "
                             f"it; wait for it to end, or end it with: sfhpc cancel {job_id}")
    return run_dir


def template_text(recipe: Recipe, cluster: ClusterMap, plan: LaunchPlan) -> str:
    """A batch script that runs any recipe of this shape: ``sbatch SCRIPT RECIPE.yaml``."""
    usage = ": \"${1:?usage: sbatch " + "<this script> RECIPE.yaml (run from the project folder)}\""
    python = '"${SFHPC_PYTHON:-python3}"'
    # The map's path comes from the command line: escaped, it stays one word whatever it holds.
    default_map = f'export SFHPC_CLUSTER_MAP="${{SFHPC_CLUSTER_MAP:-{double_quoted(cluster.source)}}}"'
    spec = spec_for_plan(
        plan, recipe, f'{python} -m sfhpc.rank "$@"', output=None, python=python,
        agent_hosts=None if plan.agent_hosts is None else agent_hosts_command(python, '"$@"'),
        setup=(usage, default_map),
        header=(*_header(recipe, cluster, plan),
                f"Written by: sfhpc render {shlex.quote(recipe.source)} --cluster {shlex.quote(cluster.source)} "
                "--template",
                "Run a recipe of the same shape with: sbatch THIS_FILE RECIPE.yaml"),
    )
    return render_sbatch(spec)
