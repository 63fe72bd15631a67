"""The cluster map of this machine alone, for runs without Slurm.

The recipe is placed on a *local* map (one pool that offers every tag the recipe asks for), so the rank
table, roles and components are the ones a Slurm launch would give.
"""

from __future__ import annotations

import os

from sfhpc.config.cluster import ClusterMap, Pool
from sfhpc.config.recipe import Recipe

LOCAL_MAP_NAME = "local"  # `--cluster local`: place the recipe on this machine alone


def local_cluster_map(recipe: Recipe) -> ClusterMap:
    """A map of this machine: one pool carrying every tag the recipe needs, with room for every role."""
    tags = tuple(sorted({t for r in recipe.roles for t in r.tags}))
    nodes = sum(r.nodes for r in recipe.roles if r.owns_nodes)
    cpus = max(os.cpu_count() or 1, sum(r.num_tasks * r.cpus_per_task for r in recipe.roles))
    gpus = max(r.tasks_per_node * r.gpus_per_task for r in recipe.roles)
    # Every "node" of the local map is this machine: each gets its share of the memory (the memory plan
    # checks a CPU rank against its node's share).
    host_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (1 << 20)
    pool = Pool(name="local", partition="local", nodes=nodes, tags=tags, cpus_per_node=cpus,
                memory_mb=max(1, host_mb // max(nodes, 1)), gpus_per_node=gpus)
    return ClusterMap(cluster="local", pools=(pool,), source="(this machine)")
