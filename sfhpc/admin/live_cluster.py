"""What the live Slurm cluster says about its partitions, nodes and settings (from sinfo, scontrol and srun)."""

from __future__ import annotations

import dataclasses
import re

from sfhpc.errors import SlurmError
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
    config: dict[str, str] = dataclasses.field(default_factory=dict)  # `scontrol show config`: key -> value
    # `scontrol show partition -o`: partition -> its settings (GraceTime, PreemptMode, ...)
    partition_settings: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    node_states: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)  # node -> (state, reason)
    mpi_plugins: tuple[str, ...] = ()  # `srun --mpi=list`
    # `sacctmgr show qos`: QOS -> its PreemptMode and GraceTime (empty without accounting)
    qos: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)


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


def parse_config(text: str) -> dict[str, str]:
    """``scontrol show config``: ``Key = value`` lines (the header and the plugin sections' other lines skipped)."""
    config: dict[str, str] = {}
    for line in text.splitlines():
        match = re.match(r"^(\w+)\s+=\s?(.*)$", line)
        if match:
            config.setdefault(match.group(1), match.group(2).strip())
    return config


def parse_partitions(text: str) -> dict[str, dict[str, str]]:
    """``scontrol show partition -o``: one line per partition of ``Key=value`` words."""
    partitions: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        settings = dict(word.split("=", 1) for word in line.split() if "=" in word)
        if "PartitionName" in settings:
            partitions[settings["PartitionName"]] = settings
    return partitions


def parse_node_states(text: str) -> dict[str, tuple[str, str]]:
    """``sinfo -N -h -o '%N|%T|%E'``: node -> (state, reason); a node listed once per partition counts once."""
    states: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        fields = line.strip().split("|", 2)
        if len(fields) == 3:
            states[fields[0]] = (fields[1], "" if fields[2] == "none" else fields[2])
    return states


def parse_mpi_plugins(text: str) -> tuple[str, ...]:
    """``srun --mpi=list``: the plugin names, one per indented line after the heading."""
    return tuple(line.strip() for line in text.splitlines()
                 if line.startswith(("\t", " ")) and line.strip() and " " not in line.strip())


def parse_qos(text: str) -> dict[str, dict[str, str]]:
    """``sacctmgr -nP show qos format=name,preemptmode,gracetime``: QOS -> {PreemptMode, GraceTime}."""
    qos = {}
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) == 3 and fields[0]:
            qos[fields[0]] = {"PreemptMode": fields[1], "GraceTime": fields[2]}
    return qos


def _optional(args: list[str]) -> str:
    """A Slurm command a cluster may lack (sacctmgr without accounting): its output, or nothing."""
    try:
        return slurm_command(args)
    except SlurmError:
        return ""


def query_live_cluster() -> LiveCluster:
    partitions, nodes = parse_sinfo(slurm_command(["sinfo", "-N", "-h", "-o", "%N|%P|%f|%c|%m|%G"]))
    config = parse_config(slurm_command(["scontrol", "show", "config"]))
    return LiveCluster(config.get("ClusterName", ""), partitions, nodes, config=config,
                       partition_settings=parse_partitions(slurm_command(["scontrol", "show", "partition", "-o"])),
                       node_states=parse_node_states(slurm_command(["sinfo", "-N", "-h", "-o", "%N|%T|%E"])),
                       mpi_plugins=parse_mpi_plugins(slurm_command(["srun", "--mpi=list"])),
                       qos=parse_qos(_optional(["sacctmgr", "-nP", "show", "qos",
                                                "format=name,preemptmode,gracetime"])))
