"""What the live Slurm cluster says about its partitions and nodes (from sinfo and scontrol)."""

from __future__ import annotations

import dataclasses
import re

from sfhpc.launch.jobs import slurm_command


@dataclasses.dataclass(frozen=True)
class LiveNode:
    name: str
    features: frozenset[str]
    cpus: int
    memory_mb: int
    gpus: int


@dataclasses.dataclass(frozen=True)
class LiveCluster:
    name: str
    partitions: dict[str, tuple[str, ...]]   # partition -> node names
    nodes: dict[str, LiveNode]


def _gpus(gres: str) -> int:
    """``gpu:8`` / ``gpu:h100:8(S:0-1)`` / ``(null)`` -> GPU count."""
    total = 0
    for item in gres.split(","):
        match = re.match(r"gpu(?::[^:(]+)?:(\d+)", item.strip())
        if match:
            total += int(match.group(1))
    return total


def parse_sinfo(text: str) -> tuple[dict[str, tuple[str, ...]], dict[str, LiveNode]]:
    """Parse ``sinfo -N -h -o '%N|%P|%f|%c|%m|%G'`` (one line per node and partition)."""
    partitions: dict[str, list[str]] = {}
    nodes: dict[str, LiveNode] = {}
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 6:
            continue
        name, partition, features, cpus, memory, gres = fields
        partition = partition.rstrip("*")  # sinfo marks the default partition with '*'
        partitions.setdefault(partition, [])
        if name not in partitions[partition]:
            partitions[partition].append(name)
        feature_set = frozenset() if features in ("(null)", "") else frozenset(features.split(","))
        nodes[name] = LiveNode(name, feature_set, int(cpus), int(memory.rstrip("+")), _gpus(gres))
    return {p: tuple(n) for p, n in partitions.items()}, nodes


def query_live_cluster() -> LiveCluster:
    partitions, nodes = parse_sinfo(slurm_command(["sinfo", "-N", "-h", "-o", "%N|%P|%f|%c|%m|%G"]))
    config = slurm_command(["scontrol", "show", "config"])
    match = re.search(r"^ClusterName\s*=\s*(\S+)", config, re.MULTILINE)
    return LiveCluster(match.group(1) if match else "", partitions, nodes)
