"""A launch plan: where every rank of a recipe runs on a cluster (the heterogeneous job's components, the rank
table). Pure data; `sfhpc.plan.resolve` builds one, `sfhpc.plan.run_memory` checks its memory."""

from __future__ import annotations

import dataclasses

from sfhpc.config.cluster import Pool


@dataclasses.dataclass(frozen=True)
class Component:
    """One component of the heterogeneous job: nodes of one pool and the ranks placed on them."""

    index: int
    pool: Pool
    nodes: int
    task_roles: tuple[tuple[str, ...], ...]   # for each task of the component, in order: its roles
    tasks_per_node: int | None                # set when every node runs the same number of tasks
    cpus_per_task: int
    gpus_per_node: int
    in_world: bool = True                     # False for agent hosts: tasks of a step of their own, no ranks

    @property
    def num_tasks(self) -> int:
        return len(self.task_roles)

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles with ranks in this component, in order of first appearance."""
        return tuple(dict.fromkeys(r for roles in self.task_roles for r in roles))


@dataclasses.dataclass(frozen=True)
class RankSlot:
    """What the plan says about one world rank."""

    rank: int
    component: int
    task_in_component: int
    roles: tuple[str, ...]
    tags: tuple[str, ...]     # the capability tags of the node the rank runs on
    pool: str


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """Where every rank of a recipe runs on a given cluster."""

    recipe: str
    cluster: str
    components: tuple[Component, ...]

    @property
    def world(self) -> tuple[Component, ...]:
        """The components whose tasks are ranks of the MPI world (all but the agent hosts'), first in order."""
        return tuple(c for c in self.components if c.in_world)

    @property
    def agent_hosts(self) -> Component | None:
        """The agents role's component (the last one), if the recipe has one."""
        return next((c for c in self.components if not c.in_world), None)

    @property
    def world_size(self) -> int:
        return sum(c.num_tasks for c in self.world)

    @property
    def tasks_per_component(self) -> tuple[int, ...]:
        """Ranks per component of the MPI world."""
        return tuple(c.num_tasks for c in self.world)

    def ranks(self) -> tuple[RankSlot, ...]:
        """The rank table: world ranks number the tasks of component 0, then component 1, ..."""
        slots, rank = [], 0
        for comp in self.world:
            for task, roles in enumerate(comp.task_roles):
                slots.append(RankSlot(rank, comp.index, task, roles, comp.pool.tags, comp.pool.name))
                rank += 1
        return tuple(slots)

    def describe(self) -> str:
        """A short human-readable table of the plan."""
        lines = [f"recipe {self.recipe} on cluster {self.cluster}: {len(self.components)} component(s), "
                 f"{self.world_size} ranks"]
        for c in self.components:
            gpus = f", {c.gpus_per_node} GPU/node" if c.gpus_per_node else ""
            outside = "" if c.in_world else " (agent hosts, outside the MPI world)"
            lines.append(f"  component {c.index}: {c.pool.label} x{c.nodes} node(s), {c.num_tasks} task(s) "
                         f"[{', '.join(c.roles)}], tags {','.join(c.pool.tags)}{gpus}{outside}")
        return "\n".join(lines)
