"""The cluster tag map: what an admin writes to describe the hardware in capability tags.

A *pool* is a set of identical nodes that a job reaches with one partition and, optionally, one
feature constraint (``partition: gpu``, ``constraint: h100``). The admin gives each pool the capability
tags its nodes offer (``train``, ``rollout``, ``reward`` ...) and what one node holds. Recipes ask for
tags; they never name partitions, so a recipe runs unchanged on every site with a map.

    cluster: sfhpcdev
    pools:
      h100:
        partition: train
        constraint: h100
        nodes: 2
        tags: [train, rollout]
        cpus_per_node: 4
        gpus_per_node: 0
        memory_mb: 4000
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path

from sfhpc.config.schema import Where, build, doc, setting
from sfhpc.config.yaml_source import read_yaml

# Tags and pool names are used in communicator names, sbatch flags and file names: keep them simple.
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")


def check_name(value: str, where: Where, what: str) -> None:
    if not _NAME.match(value):
        raise where.error(f"{what} {value!r} must start with a letter and hold only letters, digits, '-' and '_'")


@dataclasses.dataclass(frozen=True)
class Pool:
    """Identical nodes reached through one partition (and optional feature constraint)."""

    name: str = dataclasses.field(metadata=doc("the pool's name (letters, digits, '-' and '_')"))
    partition: str = dataclasses.field(metadata=doc("the Slurm partition its nodes are in"))
    nodes: int = dataclasses.field(metadata=doc("nodes in the pool (tags check compares it with the live partition)"))
    tags: tuple[str, ...] = dataclasses.field(metadata=doc("the capability tags its nodes offer; recipes ask for "
                                                           "tags, never partitions"))
    cpus_per_node: int = dataclasses.field(metadata=doc("CPU cores per node (checked against the live nodes)"))
    memory_mb: int = dataclasses.field(metadata=doc("memory per node in MB, Slurm's RealMemory (checked against the "
                                                    "live nodes)"))
    constraint: str | None = setting(None, "a node feature that selects the pool's nodes within the partition "
                                           "(--constraint; a&b: both)")
    gpus_per_node: int = setting(0, "GPUs per node, Slurm's gres/gpu (checked against the live nodes)")
    gpu_type: str | None = setting(None, "the GPU model (h100, l40s): shown by tags show, read by the simulator's cost "
                                         "model")
    gpu_memory_gib: float = setting(0.0, "memory of one GPU in GiB (80 for an H100): where a trainer rank shares its "
                                         "GPU with an engine, the plan checks that both fit (0: not said, not checked)")
    interconnect: str | None = setting(None, "the node's network, for the reader (not checked, not used)")

    def validate(self, where: Where) -> None:
        check_name(self.name, where, "pool name")
        if not self.tags:
            raise where.child("tags").error("a pool needs at least one capability tag")
        for tag in self.tags:
            check_name(tag, where.child("tags"), "tag")
        for key in ("nodes", "cpus_per_node", "memory_mb"):
            if getattr(self, key) < 1:
                raise where.child(key).error(f"must be at least 1, found {getattr(self, key)}")
        if self.gpus_per_node < 0:
            raise where.child("gpus_per_node").error(f"must be 0 or more, found {self.gpus_per_node}")
        if not self.gpu_memory_gib >= 0:
            raise where.child("gpu_memory_gib").error(f"must be 0 or more GiB, found {self.gpu_memory_gib}")

    @property
    def label(self) -> str:
        """``partition`` or ``partition[constraint]``: how the pool shows up in tables and messages."""
        return f"{self.partition}[{self.constraint}]" if self.constraint else self.partition


@dataclasses.dataclass(frozen=True)
class ClusterMap:
    """Every pool of a cluster, in the admin's order of preference."""

    cluster: str = dataclasses.field(metadata=doc("the cluster's name as Slurm knows it (ClusterName; tags check "
                                                  "compares them)"))
    pools: tuple[Pool, ...] = dataclasses.field(metadata=doc("a mapping of pool name to pool, in the admin's order of "
                                                             "preference"))
    source: str = dataclasses.field(default="", compare=False, metadata={"yaml": False})

    def validate(self, where: Where) -> None:
        if not self.pools:
            raise where.child("pools").error("the map lists no pools")
        seen: dict[tuple[str, str | None], str] = {}
        for pool in self.pools:
            key = (pool.partition, pool.constraint)
            if key in seen:
                raise where.child("pools").error(
                    f"pools '{seen[key]}' and '{pool.name}' both select {pool.label}; merge them"
                )
            seen[key] = pool.name

    @property
    def tags(self) -> tuple[str, ...]:
        """Every tag some pool offers, sorted."""
        return tuple(sorted({tag for pool in self.pools for tag in pool.tags}))

    def pools_with(self, tags: tuple[str, ...] | frozenset[str]) -> tuple[Pool, ...]:
        """The pools whose nodes carry all of `tags`, in map order."""
        wanted = set(tags)
        return tuple(p for p in self.pools if wanted <= set(p.tags))


# Keys of the map that were renamed, old -> new, dotted from its top level (``*``: any pool's name); an old key
# is refused with "renamed to <new>" (see RENAMED_KEYS in `sfhpc.config.recipe`). None has been renamed yet.
RENAMED_KEYS: Mapping[str, str] = {}


def load_cluster_map(path: str | Path) -> ClusterMap:
    """Read and validate a cluster tag map; raises ConfigError naming file, line and key."""
    data = read_yaml(path)
    cluster = build(ClusterMap, data, Where(str(path), "", data.line), renamed=RENAMED_KEYS)
    return dataclasses.replace(cluster, source=str(path))
