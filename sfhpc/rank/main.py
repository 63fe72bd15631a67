"""``python -m sfhpc.rank RECIPE [--cluster MAP] [--run-dir DIR] [--probe] [--verbose] [--set KEY=VALUE ...]``:
run one rank of a recipe (``--probe``: only the launch report, no RL; ``--verbose``: the libraries' INFO lines
on the console too, not only in the rank's log; ``--set``: recipe keys over the file's).

This is what sbatch templates and ``sfhpc run`` start on every rank. The cluster map comes from
``--cluster`` (``local``: this machine alone), else ``$SFHPC_CLUSTER_MAP``, else
``recipes/cluster-dev.yaml``.
"""

from __future__ import annotations

import argparse
import os

from sfhpc.config import load_cluster_map, load_recipe
from sfhpc.config.overrides import parse as parse_overrides
from sfhpc.errors import SfhpcError
from sfhpc.plan.local_map import LOCAL_MAP_NAME, local_cluster_map
from sfhpc.plan.resolve import resolve
from sfhpc.rank.program import RankProgram, report_user_error, run_rank_main
from sfhpc.rundir import given_or_job_run_dir, make_run_dir, new_run_dir, record_job, record_recipe
from sfhpc.runtime.slurm_env import read_rank_environment

DEFAULT_CLUSTER_MAP = "recipes/cluster-dev.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sfhpc.rank", description=__doc__)
    parser.add_argument("recipe")
    parser.add_argument("--cluster", default=os.environ.get("SFHPC_CLUSTER_MAP", DEFAULT_CLUSTER_MAP))
    parser.add_argument("--run-dir", default=os.environ.get("SFHPC_RUN_DIR"))
    parser.add_argument("--probe", action="store_true", help="only the launch report: where every rank runs")
    parser.add_argument("--verbose", action="store_true",
                        help="the engine's and libraries' INFO lines on the console too, not only in the rank's log")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe key over the file's (sfhpc.config.overrides)")
    args = parser.parse_args(argv)
    env = read_rank_environment()
    try:
        overrides = parse_overrides(args.set)
        recipe = load_recipe(args.recipe, overrides)
        local = args.cluster == LOCAL_MAP_NAME
        plan = resolve(recipe, local_cluster_map(recipe) if local else load_cluster_map(args.cluster))
        run_dir = given_or_job_run_dir(recipe.output_dir, recipe.name, args.run_dir, env.job_id)
        if run_dir is None and env.world_size == 1:
            run_dir = new_run_dir(recipe.output_dir, recipe.name, group=recipe.output_group)
        elif run_dir is None:
            raise SfhpcError("several ranks need one shared run folder: pass --run-dir or set SFHPC_RUN_DIR")
        make_run_dir(run_dir, group=recipe.output_group)  # a job's own folder: 0700 (or the group's)
        if env.world_rank == 0 and env.job_id is not None and env.restart_count == 0 and not args.run_dir:
            record_job(recipe.output_dir, env.job_id, run_dir, recipe.source)
        if env.world_rank == 0 and not args.probe:
            record_recipe(run_dir, recipe.source, overrides)
    except SfhpcError as exc:
        return report_user_error(exc, env.world_rank == 0)
    return run_rank_main(RankProgram(recipe, plan, run_dir, probe=args.probe, verbose=args.verbose),
                         env.world_rank == 0)

