"""``sfhpc check``: every check that ``sfhpc run`` and ``sfhpc launch`` make before anything starts, and
nothing else, so that a recipe is known good before it waits in a queue.

The checks are the ones those commands make, called from here rather than written again: the recipe (its
keys, values and agent program, checked as it loads), the cluster map and the placement of the roles on it,
the task (its code, options, data file and reward function), the model folder, and, against a cluster map,
the batch script's own refusals. Each problem is one line; none of them writes anything. Independent parts
are all checked, so one pass names every problem; a recipe that does not load is one problem alone.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from sfhpc.config import load_cluster_map, load_recipe
from sfhpc.errors import SfhpcError
from sfhpc.plan.resolve import resolve

T = TypeVar("T")


def problems(recipe_path: str, cluster_path: str | None) -> list[str]:
    """The problems `sfhpc run` (no `cluster_path`: this machine alone) or `sfhpc launch` (against the map at
    `cluster_path`) would stop at before starting anything, one line each; empty when there are none."""
    from sfhpc.plan.local_map import local_cluster_map
    from sfhpc.rl.program import runnable_problems

    found: list[str] = []

    def attempt(check: Callable[[], T]) -> T | None:
        try:
            return check()
        except SfhpcError as exc:
            found.append(str(exc))
            return None

    recipe = attempt(lambda: load_recipe(recipe_path))
    if recipe is None:
        return found
    found += runnable_problems(recipe)
    cluster = attempt(lambda: load_cluster_map(cluster_path)) if cluster_path else local_cluster_map(recipe)
    if cluster is None:
        return found
    plan = attempt(lambda: resolve(recipe, cluster))
    if plan is not None and cluster_path:
        from sfhpc.launch.slurm_launch import executor_for

        attempt(lambda: executor_for(recipe, cluster, plan, Path(".")))
    return found
