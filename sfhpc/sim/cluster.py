"""A cluster tag map scaled to a number of GPUs, as the launch plan the scheduler is built from.

The map's first GPU pool tagged ``train`` holds the trainer (one rank per GPU), its first GPU pool tagged
``rollout`` and not ``train`` the rollout engines (one rank, one engine, per GPU). Both keep the map's
share of GPUs at every size. Trainer GPUs may be lent to rollout only where the map tags their pool
``rollout`` too, as on a real run.
"""

from __future__ import annotations

import dataclasses

from sfhpc.config.cluster import ClusterMap, Pool
from sfhpc.errors import SfhpcError
from sfhpc.plan.launch_plan import Component, LaunchPlan
from sfhpc.sim.cost_model import GPUS


@dataclasses.dataclass(frozen=True)
class SimCluster:
    name: str
    trainer_pool: Pool   # node counts scaled
    rollout_pool: Pool

    @property
    def trainer_gpus(self) -> int:
        return self.trainer_pool.nodes * self.trainer_pool.gpus_per_node

    @property
    def rollout_gpus(self) -> int:
        return self.rollout_pool.nodes * self.rollout_pool.gpus_per_node

    @property
    def gpus(self) -> int:
        return self.trainer_gpus + self.rollout_gpus

    @property
    def lending_allowed(self) -> bool:
        return "rollout" in self.trainer_pool.tags

    def gpu_type(self, rank: int) -> str:
        """World ranks: the trainer's GPUs first, then the rollout GPUs."""
        pool = self.trainer_pool if rank < self.trainer_gpus else self.rollout_pool
        assert pool.gpu_type is not None
        return pool.gpu_type

    def plan(self, *, colocated: bool) -> LaunchPlan:
        """The rank table: trainer ranks (with the rollout role too when `colocated`, as ``sync`` runs
        generate-then-train on every GPU), then the rollout ranks. The controller's rank is left out: it
        holds no GPU and takes no episodes."""
        trainer_roles = ("trainer", "rollout") if colocated else ("trainer",)
        components = []
        for index, (pool, roles) in enumerate(((self.trainer_pool, trainer_roles),
                                               (self.rollout_pool, ("rollout",)))):
            tasks = pool.nodes * pool.gpus_per_node
            components.append(Component(index=index, pool=pool, nodes=pool.nodes, task_roles=(roles,) * tasks,
                                        tasks_per_node=pool.gpus_per_node,
                                        cpus_per_task=max(1, pool.cpus_per_node // pool.gpus_per_node),
                                        gpus_per_node=pool.gpus_per_node))
        return LaunchPlan(f"simulate-{self.gpus}", self.name, tuple(components))

    def describe(self) -> str:
        t, r = self.trainer_pool, self.rollout_pool
        lend = "lendable to rollout" if self.lending_allowed else "not lendable (pool not tagged rollout)"
        return (f"{self.gpus:,} GPUs: trainer {t.nodes} x {t.gpus_per_node} {t.gpu_type} ({t.label}, tags "
                f"{','.join(t.tags)}; {lend}), rollout {r.nodes} x {r.gpus_per_node} {r.gpu_type} ({r.label})")


def _gpu_pool(cluster: ClusterMap, want: str, refuse: str | None) -> Pool:
    pools = [p for p in cluster.pools if want in p.tags and (refuse is None or refuse not in p.tags)]
    where = cluster.source or cluster.cluster
    kind = f"tagged '{want}'" + (f" and not '{refuse}'" if refuse else "")
    if not pools:
        offered = "; ".join(f"{p.name}: {', '.join(p.tags)}" for p in cluster.pools)
        raise SfhpcError(f"{where}: the simulation needs a pool {kind} (the map has {offered})")
    gpu_pools = [p for p in pools if p.gpus_per_node > 0]
    if not gpu_pools:
        raise SfhpcError(f"{where}: pool '{pools[0].name}' ({kind}) has no GPUs (gpus_per_node: 0); "
                         "the simulation models GPU nodes")
    pool = gpu_pools[0]
    if pool.gpu_type not in GPUS:
        raise SfhpcError(f"{where}: pool '{pool.name}' has gpu_type {pool.gpu_type!r}; the cost model knows "
                         f"{', '.join(GPUS)} (set gpu_type in the map)")
    return pool


def scaled_cluster(cluster: ClusterMap, gpus: int) -> SimCluster:
    """The map's trainer and rollout pools with node counts scaled so that they hold about `gpus` GPUs
    together, in the map's proportion."""
    if gpus < 2:
        raise SfhpcError(f"a simulated cluster needs at least 2 GPUs, asked for {gpus}")
    trainer = _gpu_pool(cluster, "train", None)
    rollout = _gpu_pool(cluster, "rollout", "train")
    t_gpus, r_gpus = trainer.nodes * trainer.gpus_per_node, rollout.nodes * rollout.gpus_per_node
    t_nodes = max(1, round(gpus * t_gpus / (t_gpus + r_gpus) / trainer.gpus_per_node))
    r_nodes = max(1, round((gpus - t_nodes * trainer.gpus_per_node) / rollout.gpus_per_node))
    return SimCluster(cluster.cluster, dataclasses.replace(trainer, nodes=t_nodes),
                      dataclasses.replace(rollout, nodes=r_nodes))
