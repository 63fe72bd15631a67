"""``sfhpc tags show|check``: the tag map as a table, and the map compared with the live cluster (the site's
prerequisites beside it: `sfhpc.admin.site_check`)."""

from __future__ import annotations

from collections.abc import Sequence

from sfhpc.admin.live_cluster import LiveCluster
from sfhpc.config.cluster import ClusterMap, Pool
from sfhpc.table import format_table


def show_tags(cluster: ClusterMap) -> str:
    """One row per tag: the pools (partition[constraint]) that offer it, with node counts and sizes."""
    rows = []
    for tag in cluster.tags:
        pools = cluster.pools_with((tag,))
        rows.append((
            tag,
            ", ".join(p.label for p in pools),
            str(sum(p.nodes for p in pools)),
            str(sum(p.nodes * p.gpus_per_node for p in pools)),
            ", ".join(f"{p.name}: {p.cpus_per_node} CPU, {p.gpus_per_node} GPU"
                      f"{' ' + p.gpu_type if p.gpu_type else ''}, {p.memory_mb} MB" for p in pools),
        ))
    head = f"cluster {cluster.cluster} ({cluster.source}): {len(cluster.pools)} pool(s), {len(cluster.tags)} tag(s)"
    return head + "\n" + format_table(("tag", "partitions", "nodes", "gpus", "per node"), rows)


def pool_nodes(pool: Pool, live: LiveCluster) -> list[str]:
    """The live nodes of a pool: its partition's, those with the constraint's features."""
    names = live.partitions.get(pool.partition, ())
    if pool.constraint is None:
        return list(names)
    wanted = set(pool.constraint.split("&"))
    return [n for n in names if wanted <= live.nodes[n].features]


def check_tags(cluster: ClusterMap, live: LiveCluster) -> list[str]:
    """Every difference between the map and the live cluster, one line each (empty: they agree)."""
    problems = []
    if cluster.cluster != live.name:
        problems.append(f"cluster: the map says '{cluster.cluster}', the live cluster is '{live.name}'")
    for pool in cluster.pools:
        where = f"pool '{pool.name}'"
        if pool.partition not in live.partitions:
            known = ", ".join(sorted(live.partitions))
            problems.append(f"{where}: partition '{pool.partition}' does not exist (partitions: {known})")
            continue
        nodes = pool_nodes(pool, live)
        if pool.constraint is not None and not nodes:
            have = sorted({f for n in live.partitions[pool.partition] for f in live.nodes[n].features})
            problems.append(f"{where}: no node of partition '{pool.partition}' has feature "
                            f"'{pool.constraint}' (features there: {', '.join(have) or 'none'})")
            continue
        if len(nodes) != pool.nodes:
            problems.append(f"{where}: the map says {pool.nodes} node(s), {pool.label} has {len(nodes)} "
                            f"({','.join(nodes)})")
        for attr, live_attr, unit in (("cpus_per_node", "cpus", "CPUs"), ("memory_mb", "memory_mb", "MB"),
                                      ("gpus_per_node", "gpus", "GPUs")):
            expected = getattr(pool, attr)
            wrong = [f"{n}={getattr(live.nodes[n], live_attr)}" for n in nodes
                     if getattr(live.nodes[n], live_attr) != expected]
            if wrong:
                problems.append(f"{where}: {attr} is {expected} in the map, live nodes have {unit} "
                                f"{', '.join(wrong)}")
    return problems


def format_check(cluster: ClusterMap, live: LiveCluster, problems: list[str], site: Sequence[str] = ()) -> str:
    """The pools as a table, then each mismatch of the map and each problem of the site (`check_site`)."""
    rows = []
    for pool in cluster.pools:
        mine = [p for p in problems if p.startswith(f"pool '{pool.name}'")]
        nodes = pool_nodes(pool, live) if pool.partition in live.partitions else []
        rows.append((pool.name, pool.label, ",".join(pool.tags), f"{len(nodes)}/{pool.nodes}",
                     "MISMATCH" if mine else "ok"))
    lines = [f"checking {cluster.source} against live cluster '{live.name}'",
             format_table(("pool", "partition", "tags", "nodes live/map", "result"), rows)]
    lines += [f"mismatch: {p}" for p in problems]
    lines += [f"site: {p}" for p in site]
    if problems:
        lines.append(f"{len(problems)} mismatch(es): fix the map (or the cluster) and check again")
    else:
        lines.append("the map matches the live cluster")
    if site:
        lines.append(f"{len(site)} site problem(s): runs may fail or lose work until they are fixed")
    return "\n".join(lines)
