"""The site check's reading of Slurm's outputs and its rules, on outputs as the dev cluster prints them (its
`scontrol show config`, `scontrol show partition -o`, `sinfo` and `srun --mpi=list`, shortened), changed
the way a site's could differ. The same check against the live dev cluster, with its settings changed by
`scontrol update`, is in tests/launch/test_slurm_jobs.py."""

from __future__ import annotations

import dataclasses

import pytest

from sfhpc.admin.live_cluster import (
    LiveCluster,
    LiveNode,
    parse_config,
    parse_mpi_plugins,
    parse_node_states,
    parse_partitions,
    parse_qos,
)
from sfhpc.admin.site_check import _seconds, check_site
from sfhpc.config import load_cluster_map
from sfhpc.config.recipe import LaunchSpec
from tests.conftest import RECIPES

CONFIG = """\
Configuration data as of 2026-12-06T05:56:11
ClusterName             = sfhpcdev
JobRequeue              = 1
KillWait                = 10 sec
PreemptMode             = REQUEUE
PreemptType             = preempt/partition_prio
SchedulerType           = sched/backfill
SelectType              = select/cons_tres
SLURM_VERSION           = 22.05.8

Cgroup Support Configuration:
AllowedRAMSpace         = 100.0%
"""
PARTITIONS = """\
PartitionName=train Default=YES GraceTime=5 Nodes=n[1-2] PriorityTier=1 PreemptMode=REQUEUE State=UP
PartitionName=rollout Default=NO GraceTime=5 Nodes=n[3-4] PriorityTier=1 PreemptMode=REQUEUE State=UP
PartitionName=urgent Default=NO GraceTime=0 Nodes=n[1-4] PriorityTier=10 PreemptMode=REQUEUE State=UP
"""
STATES = "n1|idle|none\nn1|idle|none\nn2|drained|disk replaced\nn3|down*|Not responding\nn4|mixed|none\n"
MPI = ("MPI plugin types are...\n\tpmix\n\tnone\n\tcray_shasta\n\tpmi2\n"
       "specific pmix plugin versions available: pmix_v4\n")


QOS = "normal|cluster|00:00:00\nscavenger|cancel|00:00:30\nlong|requeue|00:10:00\n"


def live(**changes: object) -> LiveCluster:
    nodes = {f"n{i}": LiveNode(f"n{i}", frozenset({"train", "h100"} if i < 3 else {"rollout", "l40s"}), 4, 4000, 0)
             for i in range(1, 5)}
    cluster = LiveCluster("sfhpcdev", {"train": ("n1", "n2"), "rollout": ("n3", "n4"), "urgent": tuple(nodes)},
                          nodes, config=parse_config(CONFIG), partition_settings=parse_partitions(PARTITIONS),
                          node_states={n: ("idle", "") for n in nodes}, mpi_plugins=parse_mpi_plugins(MPI),
                          qos=parse_qos(QOS))
    return dataclasses.replace(cluster, **changes)  # type: ignore[arg-type]


def test_outputs_are_read_as_slurm_prints_them() -> None:
    config = parse_config(CONFIG)
    assert (config["KillWait"], config["SLURM_VERSION"], config["PreemptType"]) == (
        "10 sec", "22.05.8", "preempt/partition_prio")
    assert "AllowedRAMSpace" in config and "Configuration" not in config
    partitions = parse_partitions(PARTITIONS)
    assert list(partitions) == ["train", "rollout", "urgent"]
    assert (partitions["urgent"]["GraceTime"], partitions["train"]["PreemptMode"]) == ("0", "REQUEUE")
    assert parse_node_states(STATES) == {"n1": ("idle", ""), "n2": ("drained", "disk replaced"),
                                         "n3": ("down*", "Not responding"), "n4": ("mixed", "")}
    assert parse_mpi_plugins(MPI) == ("pmix", "none", "cray_shasta", "pmi2")
    assert parse_qos(QOS)["scavenger"] == {"PreemptMode": "cancel", "GraceTime": "00:00:30"}
    assert [_seconds(v) for v in ("10 sec", "5", "00:02:00", "1-00:00:30", "0")] == [10, 5, 120, 86430, 0]


def test_the_dev_cluster_as_it_is_has_no_problem() -> None:
    cluster = load_cluster_map(RECIPES / "cluster-dev.yaml")
    assert check_site(cluster, live()) == []
    assert check_site(cluster, live(), LaunchSpec(signal_grace_s=15)) == []


@pytest.mark.parametrize(("changes", "launch", "expected"), [
    ({"node_states": parse_node_states(STATES)}, None,
     ["pool 'h100': n2 drained ('disk replaced'): not capacity, 1 of its 2 node(s) can start a job",
      "pool 'l40s': n3 down ('Not responding'): not capacity, 1 of its 2 node(s) can start a job"]),
    ({"partition_settings": parse_partitions(PARTITIONS.replace("GraceTime=5 Nodes=n[3-4]",
                                                                "GraceTime=0 Nodes=n[3-4]"))},
     LaunchSpec(signal_grace_s=15),
     ["partition 'rollout': a preempted job is killed GraceTime 0 s + KillWait 10 s = 10 s after TERM, less than the "
      "15 s the recipe gives a run to checkpoint (launch.signal_grace_s); raise the partition's GraceTime or lower "
      "signal_grace_s"]),
    ({"partition_settings": parse_partitions(PARTITIONS.replace("PreemptMode=REQUEUE State=UP\nPartitionName=rollout",
                                                                "PreemptMode=CANCEL State=UP\nPartitionName=rollout"))},
     None, ["partition 'train': PreemptMode=CANCEL: a preempted run is cancelled"]),
    ({"partition_settings": parse_partitions(PARTITIONS.replace("PreemptMode=REQUEUE", "PreemptMode=OFF", 1))},
     LaunchSpec(signal_grace_s=100),  # no grace line for a partition that never preempts
     ["partition 'train': PreemptMode=OFF under preempt/partition_prio: a run there is never preempted",
      "partition 'rollout': a preempted job is killed GraceTime 5 s + KillWait 10 s = 15 s"]),
    ({"config": parse_config(CONFIG.replace("22.05.8", "21.08.5").replace("sched/backfill", "sched/builtin")
                             .replace("cons_tres", "cons_res"))}, None,
     ["Slurm 21.08.5: sfhpc needs 22.05 or later", "SchedulerType=sched/builtin: heterogeneous jobs are started by the "
      "backfill scheduler only"]),  # cons_res is no problem without GPUs
    ({"mpi_plugins": ("none", "pmi2")}, LaunchSpec(mpi="pmix_v4", signal_grace_s=15),
     ["srun --mpi=pmix_v4 (launch.mpi): this Slurm has the MPI plugins none, pmi2"]),
], ids=["drained-and-down", "grace", "cancel", "off", "old-slurm", "no-pmix"])
def test_each_problem_is_one_line(changes: dict[str, object], launch: LaunchSpec | None, expected: list[str]) -> None:
    problems = check_site(load_cluster_map(RECIPES / "cluster-dev.yaml"), live(**changes), launch)
    assert len(problems) == len(expected), problems
    for line, start in zip(problems, expected):
        assert line.startswith(start), (line, start)


def test_gpu_pools_need_cons_tres_and_preempt_none_checks_no_grace() -> None:
    cluster = load_cluster_map(RECIPES / "cluster-h100-l40s.yaml")
    site = live(config=parse_config(CONFIG.replace("cons_tres", "cons_res").replace("partition_prio", "none")),
                partition_settings={})
    assert check_site(cluster, site, LaunchSpec(signal_grace_s=600)) == [
        "SelectType=select/cons_res: sfhpc asks for GPUs per task (--gpus-per-task, --gpu-bind), which needs "
        "select/cons_tres"]


def test_under_qos_preemption_the_runs_qos_decides() -> None:
    """preempt/qos: the partitions' PreemptMode is not what applies, the run's QOS is (``cluster``: the global
    mode); without launch.qos, ``normal``."""
    cluster = load_cluster_map(RECIPES / "cluster-dev.yaml")
    site = live(config=parse_config(CONFIG.replace("partition_prio", "qos")),
                partition_settings=parse_partitions(PARTITIONS.replace("REQUEUE", "CANCEL")))
    assert check_site(cluster, site) == []  # normal: the cluster's REQUEUE
    assert check_site(cluster, site, LaunchSpec(signal_grace_s=600, qos="long")) == []  # 600 s + 10 s
    [cancel, grace] = check_site(cluster, site, LaunchSpec(signal_grace_s=60, qos="scavenger"))
    assert cancel.startswith("QOS 'scavenger': PreemptMode=CANCEL: a preempted run is cancelled")
    assert grace.startswith("QOS 'scavenger': a preempted job is killed GraceTime 30 s + KillWait 10 s = 40 s after "
                            "TERM, less than the 60 s") and "raise the QOS's GraceTime" in grace
