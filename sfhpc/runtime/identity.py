"""Rank identity: the launcher's view of a process (`slurm_env`) joined with the launch plan."""

from __future__ import annotations

import dataclasses

from sfhpc.errors import SfhpcError
from sfhpc.plan.launch_plan import LaunchPlan, RankSlot
from sfhpc.runtime.slurm_env import RankEnvironment


@dataclasses.dataclass(frozen=True)
class RankIdentity:
    """Who this rank is: its place in the job, its node, its roles and its node's capability tags."""

    env: RankEnvironment
    slot: RankSlot

    @property
    def rank(self) -> int:
        return self.env.world_rank

    @property
    def roles(self) -> tuple[str, ...]:
        return self.slot.roles

    @property
    def tags(self) -> tuple[str, ...]:
        return self.slot.tags

    def has_role(self, role: str) -> bool:
        return role in self.slot.roles

    def as_record(self) -> dict[str, object]:
        """A JSON-friendly description (what the rank reports)."""
        return {
            "rank": self.rank,
            "world_size": self.env.world_size,
            "component": self.env.component,
            "task_in_component": self.env.task_in_component,
            "local_rank": self.env.local_rank,
            "node": self.env.node,
            "roles": list(self.roles),
            "tags": list(self.tags),
            "pool": self.slot.pool,
            "job_id": self.env.job_id,
            "launcher": self.env.launcher,
            "restart_count": self.env.restart_count,
        }


def identify(plan: LaunchPlan, env: RankEnvironment) -> RankIdentity:
    """Match the running job against the plan; raises SfhpcError when the allocation has another shape."""
    if env.tasks_per_component != plan.tasks_per_component:
        raise SfhpcError(
            f"this job has {len(env.tasks_per_component)} component(s) with tasks "
            f"{list(env.tasks_per_component)}, but recipe '{plan.recipe}' on cluster '{plan.cluster}' needs "
            f"{len(plan.components)} with tasks {list(plan.tasks_per_component)}; "
            f"write a matching script with: sfhpc render RECIPE --template"
        )
    slot = plan.ranks()[env.world_rank]
    assert slot.component == env.component, "rank table and launcher disagree on the component"
    return RankIdentity(env, slot)
