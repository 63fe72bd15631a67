"""The site's prerequisites for sfhpc, read from the live Slurm: what `sfhpc tags check` adds to the map's check.

The map's check (`sfhpc.admin.tags.check_tags`) compares pools with partitions; this one reads the settings a
run depends on (docs/cluster-admins.md, "Site prerequisites"): the Slurm version and scheduler, the GPU
selection plugin, srun's MPI plugins, the state of each pool's nodes, and what a preemption does to a run on
the partitions the pools use (under QOS-based preemption, in the run's QOS). Each problem is one line naming
the setting, what it does to a run and the fix; none: the site is ready as far as Slurm can tell.
"""

from __future__ import annotations

import re

from sfhpc.admin.live_cluster import LiveCluster
from sfhpc.admin.tags import pool_nodes
from sfhpc.config.cluster import ClusterMap
from sfhpc.config.recipe import LaunchSpec

MIN_SLURM = (22, 5)  # the oldest release sfhpc is tested on (docs/cluster-admins.md)
# Node states that are not capacity: a job cannot start there (sinfo's long names, without their suffixes).
UNUSABLE_STATES = ("down", "drained", "draining", "drain", "fail", "failing", "inval", "maint", "unknown",
                   "not_responding", "future", "reboot_issued", "power_down", "powered_down")


def check_site(cluster: ClusterMap, live: LiveCluster, launch: LaunchSpec | None = None) -> list[str]:
    """Every prerequisite the live cluster misses, one line each; `launch` (a recipe's) adds the checks that
    depend on it: its MPI plugin, and its stopping time against the grace a preemption gives."""
    mpi = launch.mpi if launch is not None else LaunchSpec().mpi
    return [*_scheduler(cluster, live), *_mpi(live, mpi), *_nodes(cluster, live), *_preemption(cluster, live, launch)]


def _scheduler(cluster: ClusterMap, live: LiveCluster) -> list[str]:
    problems = []
    version = live.config.get("SLURM_VERSION", "")
    parts = re.match(r"(\d+)\.(\d+)", version)
    if parts and (int(parts.group(1)), int(parts.group(2))) < MIN_SLURM:
        problems.append(f"Slurm {version}: sfhpc needs {MIN_SLURM[0]}.{MIN_SLURM[1]:02d} or later (a run is one "
                        "heterogeneous job)")
    scheduler = live.config.get("SchedulerType", "")
    if scheduler and scheduler != "sched/backfill":
        problems.append(f"SchedulerType={scheduler}: heterogeneous jobs are started by the backfill scheduler only, "
                        "so a run would pend for ever; set SchedulerType=sched/backfill")
    select = live.config.get("SelectType", "")
    if select and select != "select/cons_tres" and any(p.gpus_per_node for p in cluster.pools):
        problems.append(f"SelectType={select}: sfhpc asks for GPUs per task (--gpus-per-task, --gpu-bind), which "
                        "needs select/cons_tres")
    return problems


def _mpi(live: LiveCluster, plugin: str) -> list[str]:
    if not live.mpi_plugins:
        return []
    family = plugin.split("_")[0]  # pmix_v4 is a version of pmix
    if plugin in live.mpi_plugins or family in live.mpi_plugins:
        return []
    return [f"srun --mpi={plugin} (launch.mpi): this Slurm has the MPI plugins {', '.join(live.mpi_plugins)}; "
            "build Slurm with PMIx (mpi/pmix) or set launch.mpi to one of them"]


def _nodes(cluster: ClusterMap, live: LiveCluster) -> list[str]:
    problems = []
    for pool in cluster.pools:
        if pool.partition not in live.partitions:
            continue  # the map's check names it
        nodes = pool_nodes(pool, live)
        unusable = []
        for node in nodes:
            state, reason = live.node_states.get(node, ("", ""))
            base = state.rstrip("*~#%!$@^-").lower()
            if base.split("+")[0] in UNUSABLE_STATES:
                unusable.append(f"{node} {base}" + (f" ('{reason}')" if reason else ""))
        if unusable:
            problems.append(f"pool '{pool.name}': {', '.join(unusable)}: not capacity, "
                            f"{len(nodes) - len(unusable)} of its {len(nodes)} node(s) can start a job")
    return problems


def _seconds(value: str) -> int:
    """A Slurm duration as scontrol prints it: ``10 sec``, ``5``, ``00:02:00``, ``1-00:00:00``."""
    value = value.replace("sec", "").strip()
    days, _, clock = value.rpartition("-")
    total = 0
    for part in clock.split(":"):
        total = total * 60 + int(part or 0)
    return total + int(days or 0) * 86400


def _preemption(cluster: ClusterMap, live: LiveCluster, launch: LaunchSpec | None) -> list[str]:
    """What a preemption does to a run: sfhpc resumes a requeued run from its checkpoint, which the run writes
    between TERM and the kill (GraceTime, then KillWait). Under ``preempt/qos`` the run's QOS (the recipe's
    ``launch.qos``, else ``normal``) says what happens; under the other types, each partition a pool uses."""
    preempt_type = live.config.get("PreemptType", "preempt/none")
    if preempt_type == "preempt/none":
        return []  # nothing is ever preempted
    global_mode = live.config.get("PreemptMode", "OFF")
    if preempt_type == "preempt/qos":
        name = (launch.qos if launch is not None else None) or "normal"
        scopes = {f"QOS '{name}'": live.qos[name]} if name in live.qos else {}
    else:
        scopes = {f"partition '{p}'": live.partition_settings[p]
                  for p in dict.fromkeys(pool.partition for pool in cluster.pools) if p in live.partition_settings}
    kill_wait = _seconds(live.config.get("KillWait", "30"))
    problems = []
    for where, settings in scopes.items():
        own_mode = settings.get("PreemptMode", "")
        mode = (own_mode if own_mode and own_mode.lower() != "cluster" else global_mode).upper()
        problems += _mode_problem(where, mode, preempt_type)
        if launch is None or not launch.requeue or mode == "OFF":
            continue
        grace = _seconds(settings.get("GraceTime", "0"))
        if grace + kill_wait < launch.signal_grace_s:
            problems.append(f"{where}: a preempted job is killed GraceTime {grace} s + KillWait {kill_wait} s = "
                            f"{grace + kill_wait} s after TERM, less than the {launch.signal_grace_s} s the recipe "
                            f"gives a run to checkpoint (launch.signal_grace_s); raise the {where.split()[0]}'s "
                            "GraceTime or lower signal_grace_s")
    return problems


def _mode_problem(where: str, mode: str, preempt_type: str) -> list[str]:
    if "CANCEL" in mode:
        return [f"{where}: PreemptMode={mode}: a preempted run is cancelled, not requeued, and its allocation's work "
                "is left to the user to restart; set PreemptMode=REQUEUE (a requeued run resumes from its checkpoint)"]
    if "SUSPEND" in mode:
        return [f"{where}: PreemptMode={mode}: a preempted run's ranks stop in the middle of their MPI calls and "
                "their peers in other components time out; set PreemptMode=REQUEUE"]
    if mode == "OFF":
        return [f"{where}: PreemptMode=OFF under {preempt_type}: a run there is never preempted, so it holds its "
                "nodes to its time limit and cannot serve as preemptible work; set PreemptMode=REQUEUE (a requeued "
                "run resumes from its checkpoint)"]
    return []
