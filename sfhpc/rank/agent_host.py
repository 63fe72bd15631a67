"""``python -m sfhpc.rank.agent_host RECIPE [--run-dir DIR] [--index N] [--bind ADDRESS]``: one agent host of a
recipe's ``agents`` role (`sfhpc.rollout.agent_host`), which plays the episodes its run's rollout ranks hand it
with the recipe's agent program. The batch script starts one per task of the role; ``sfhpc run`` one per task
beside mpiexec. Its run folder comes from ``--run-dir``, else from the Slurm job's id, as a rank's does.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from sfhpc.config import load_recipe
from sfhpc.config.overrides import parse as parse_overrides
from sfhpc.errors import SfhpcError
from sfhpc.rank.main import given_or_job_run_dir
from sfhpc.rollout.agent_host import host_name, run_host
from sfhpc.rundir import RunPaths
from sfhpc.runtime.slurm_env import current_job_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sfhpc.rank.agent_host", description=__doc__)
    parser.add_argument("recipe")
    parser.add_argument("--run-dir", default=os.environ.get("SFHPC_RUN_DIR"))
    parser.add_argument("--index", type=int, default=None, help="this host's number (default: $SLURM_PROCID)")
    parser.add_argument("--bind", default="0.0.0.0", help="the address to listen on (default: every interface)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe key over the file's (sfhpc.config.overrides)")
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, parse_overrides(args.set))
        if recipe.agent is None:
            raise SfhpcError(f"{args.recipe}: an agent host runs the recipe's agent program, but it names none")
        run_dir = given_or_job_run_dir(recipe.output_dir, recipe.name, args.run_dir, current_job_id())
        if run_dir is None:
            raise SfhpcError("an agent host needs its run's folder: pass --run-dir or set SFHPC_RUN_DIR")
        paths = RunPaths(run_dir)
        name = host_name(args.index)
        paths.logs.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(paths.agent_host_log(name))
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logging.getLogger("sfhpc").addHandler(handler)
        logging.getLogger("sfhpc").setLevel(logging.INFO)
        return asyncio.run(run_host(recipe.agent, recipe.source, paths.agent_hosts, name, bind=args.bind,
                                 timeout_s=recipe.agent.timeout_s or recipe.budgets.episode_timeout_s))
    except SfhpcError as exc:
        print(f"sfhpc agent host: error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
