"""The launch report: every rank says who and where it is; rank 0 gathers the answers over MPI.

It is the smallest program that proves a launch end to end: the ranks of every component share one
MPI world (an `Allgather` over the world communicator spans all components), and each rank's
component, roles, tags and node are what the plan says.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sfhpc.rundir import RunPaths
from sfhpc.runtime.identity import RankIdentity
from sfhpc.table import format_table


def launch_report(identity: RankIdentity, comm: Any, run_dir: Path) -> list[dict[str, Any]]:
    """Gather every rank's identity on every rank (returned, in rank order); rank 0 writes
    `run_dir/launch_report.json`."""
    import numpy as np
    from mpi4py import MPI

    mine = identity.as_record()
    everyone: list[dict[str, Any]] = comm.allgather(mine)
    # A typed buffer Allgather as well: the path large payloads (weights) will take.
    numbers = np.array([identity.rank, identity.env.component], dtype=np.int64)
    gathered = np.empty(2 * comm.Get_size(), dtype=np.int64)
    comm.Allgather([numbers, MPI.INT64_T], [gathered, MPI.INT64_T])
    pairs = gathered.reshape(-1, 2).tolist()
    if identity.rank == 0:
        report = {
            "world_size": comm.Get_size(),
            "mpi_library": MPI.Get_library_version().splitlines()[0].strip().rstrip("\x00"),
            "allgather_rank_component": pairs,
            "ranks": everyone,
        }
        path = RunPaths(run_dir).launch_report
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        print(format_report(everyone), flush=True)
        print(f"launch report: {path}", flush=True)
    return everyone


def format_report(ranks: list[dict[str, Any]]) -> str:
    header = ("rank", "component", "node", "roles", "tags")
    rows = [(str(r["rank"]), str(r["component"]), str(r["node"]), ",".join(r["roles"]), ",".join(r["tags"]))
            for r in ranks]
    return format_table(header, rows)
