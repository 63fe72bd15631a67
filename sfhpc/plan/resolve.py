"""Place a recipe's roles on a cluster: roles -> tags -> pools -> heterogeneous job components.

Every role that owns nodes becomes one component of the heterogeneous job (components never share
nodes in Slurm). Roles placed *with* another role add ranks to that role's component; roles
*colocated* with another role share its ranks. The component that holds the controller comes first, and
the controller is its first task, so the controller is world rank 0.

A colocated recipe (rollout on the trainer's ranks) and a disaggregated one (rollout on nodes of its
own) come out of the same resolver: the first gives one component, the second several.

An ``agents`` role (agent hosts, `sfhpc.rollout.agent_host`) is a component too, the last one, but outside the
MPI world: its tasks are started by a step of their own and are no ranks, so that losing one ends nothing else.
"""

from __future__ import annotations

from sfhpc.config.cluster import ClusterMap, Pool
from sfhpc.config.recipe import Recipe, Role
from sfhpc.errors import ResolveError
from sfhpc.plan.launch_plan import Component, LaunchPlan
from sfhpc.plan.run_memory import memory_problems


def resolve(recipe: Recipe, cluster: ClusterMap) -> LaunchPlan:
    """Place `recipe` on `cluster`; raises ResolveError with one actionable line when it cannot."""
    owners = [r for r in recipe.roles if r.owns_nodes]
    required = {r.name: _required_tags(recipe, r) for r in owners}
    free_nodes = {p.name: p.nodes for p in cluster.pools}
    chosen: dict[str, Pool] = {}
    # Most constrained role first, so a flexible role does not take the only pool another one fits.
    for role in sorted(owners, key=lambda r: len(_fitting_pools(recipe, r, required[r.name], cluster))):
        others = set().union(*(required[o.name] for o in owners if o.name != role.name))
        pool = _choose_pool(recipe, role, required[role.name], others, cluster, free_nodes)
        free_nodes[pool.name] -= role.nodes
        chosen[role.name] = pool

    def holds_controller(role: Role) -> bool:
        controller = recipe.role("controller")
        assert controller is not None
        return role.name in (controller.name, controller.place_with)

    ordered = sorted(owners, key=lambda r: (r.name == "agents", not holds_controller(r), recipe.roles.index(r)))
    components = tuple(_component(i, recipe, role, chosen[role.name]) for i, role in enumerate(ordered))
    plan = LaunchPlan(recipe.name, cluster.cluster, components)
    for problem in memory_problems(recipe, plan, cluster):
        raise ResolveError(problem)
    return plan


def _required_tags(recipe: Recipe, owner: Role) -> frozenset[str]:
    """The owner's tags plus those of every role placed or colocated with it."""
    tags = set(owner.tags)
    for role in recipe.roles:
        if owner.name in (role.place_with, role.colocate_with):
            tags.update(role.tags)
    return frozenset(tags)


def _riders(recipe: Recipe, owner: Role) -> tuple[list[Role], list[Role]]:
    placed = [r for r in recipe.roles if r.place_with == owner.name]
    colocated = [r for r in recipe.roles if r.colocate_with == owner.name]
    return placed, colocated


def _fits(recipe: Recipe, owner: Role, pool: Pool) -> str | None:
    """Why `owner` (with its riders) cannot run on one node of `pool`, or None when it can."""
    placed, colocated = _riders(recipe, owner)
    gpus = owner.tasks_per_node * max(r.gpus_per_task for r in [owner, *colocated])
    if gpus > pool.gpus_per_node:
        return f"needs {gpus} GPU(s) per node, pool '{pool.name}' has {pool.gpus_per_node}"
    # Extra ranks (the controller) all land on the component's first node.
    cpus = _cpus_per_task(owner, placed, colocated) * (owner.tasks_per_node + sum(r.tasks for r in placed))
    if cpus > pool.cpus_per_node:
        return f"needs {cpus} CPUs on its first node, pool '{pool.name}' has {pool.cpus_per_node}"
    return None


def _fitting_pools(recipe: Recipe, role: Role, tags: frozenset[str], cluster: ClusterMap) -> list[Pool]:
    return [p for p in cluster.pools_with(tags) if _fits(recipe, role, p) is None]


def _choose_pool(recipe: Recipe, role: Role, tags: frozenset[str], others: set[str],
                 cluster: ClusterMap, free_nodes: dict[str, int]) -> Pool:
    tag_text = "[" + ", ".join(sorted(tags)) + "]"
    tagged = cluster.pools_with(tags)
    if not tagged:
        offered = "; ".join(f"{p.name}: {', '.join(p.tags)}" for p in cluster.pools)
        raise ResolveError(f"role '{role.name}' needs nodes tagged {tag_text}, but no pool in "
                           f"{cluster.source or cluster.cluster} offers them all ({offered})")
    fitting = [p for p in tagged if _fits(recipe, role, p) is None]
    if not fitting:
        raise ResolveError(f"role '{role.name}' does not fit any pool tagged {tag_text}: "
                           + "; ".join(str(_fits(recipe, role, p)) for p in tagged))
    roomy = [p for p in fitting if free_nodes[p.name] >= role.nodes]
    if not roomy:
        have = ", ".join(f"pool '{p.name}' (partition {p.partition}) has {free_nodes[p.name]} free of "
                         f"{p.nodes}" for p in fitting)
        raise ResolveError(f"role '{role.name}' needs {role.nodes} node(s) tagged {tag_text}; {have}; "
                           "lower 'nodes' in the recipe or add nodes to the map")

    # Prefer pools whose special tags no other role needs (keep trainer nodes for the trainer),
    # then the pool with the fewest tags beyond what was asked, then the admin's order.
    def cost(pool: Pool) -> tuple[int, int, int]:
        extra = set(pool.tags) - tags
        return (len(extra & others), len(extra), cluster.pools.index(pool))

    return min(roomy, key=cost)


def _cpus_per_task(owner: Role, placed: list[Role], colocated: list[Role]) -> int:
    # A het component has one --cpus-per-task: the largest any of its ranks asks for.
    return max(r.cpus_per_task for r in [owner, *placed, *colocated])


def _component(index: int, recipe: Recipe, owner: Role, pool: Pool) -> Component:
    placed, colocated = _riders(recipe, owner)
    owner_roles = (owner.name, *(r.name for r in colocated))
    task_roles: list[tuple[str, ...]] = [(r.name,) for r in placed for _ in range(r.tasks)]
    task_roles += [owner_roles] * (owner.nodes * owner.tasks_per_node)
    gpus_per_task = max(r.gpus_per_task for r in [owner, *colocated])
    return Component(
        index=index,
        pool=pool,
        nodes=owner.nodes,
        task_roles=tuple(task_roles),
        tasks_per_node=owner.tasks_per_node if not placed else None,
        cpus_per_task=_cpus_per_task(owner, placed, colocated),
        gpus_per_node=owner.tasks_per_node * gpus_per_task,
        in_world=owner.name != "agents",
    )
