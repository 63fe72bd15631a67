"""Ranks for the MPI service test: rank 0 serves a trajectory manager, ranks 1 and 2 use it.

    mpiexec -n 3 python -m tests.data.mpi_service_ranks OUTDIR

Each rank writes what it saw to OUTDIR/rank-R.json; the test checks the values.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from sfhpc.data.errors import InvalidRequest, TrajectoryFinished, UnknownTrajectory
from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.service import ManagerClient, ManagerServer
from sfhpc.data.store import TrajectoryStore, open_store


def controller(comm, out: Path) -> dict:
    manager = TrajectoryManager(TrajectoryStore.create(out / "run.h5"), max_token_lag=1)
    server = ManagerServer(manager, comm)
    began, wall = time.process_time(), time.monotonic()
    server.serve()
    manager.close()
    with open_store(out / "run.h5") as reader:
        summary = reader.summary()
        marks = [(m.step, m.trajectory_id) for m in reader.marks()]
    first = server.first_one_way_failure
    return {"episodes_ended": server.episodes_ended, "served": server.served, "failed_one_way": server.failed_one_way,
            "by_status": summary.by_status,
            "marks": marks, "first_one_way": None if first is None else [first.rank, first.method, first.message],
            "heard_from": sorted(server.last_seen),
            "generated_tokens": summary.generated_tokens, "cpu_seconds": time.process_time() - began,
            "wall_seconds": time.monotonic() - wall}


def agent(comm, rank: int) -> dict:
    result: dict = {}
    with ManagerClient(comm, server_rank=0, timeout=60) as client:
        # Two members of group g from each agent rank, each generating under policy version `rank`.
        ids = [client.start([rank, j, 0], task="mpi", group="g", trajectory_id=f"r{rank}-{j}") for j in range(2)]
        for j, tid in enumerate(ids):
            client.add_generated(tid, [100 + j] * 4, [-0.25] * 4, 1, engine=f"rank-{rank}", finish_reason="abort")
            client.interrupt(tid)
            cont = client.continuation(tid, 10)
            result[f"continuation-{j}"] = [cont.prompt_tokens, cont.remaining_tokens]
            client.add_generated(tid, [200 + j] * cont.remaining_tokens, [-0.5] * cont.remaining_tokens,
                                 [2] * cont.remaining_tokens, engine=f"rank-{rank}", finish_reason="length")
            client.finish_episode(tid, reward=float(rank))
        result["status"] = client.status(ids[0])
        # An episode whose agent raised: one-way, with the reason; it spoils its own group only.
        client.fail_episode([client.start([rank], task="mpi", group=f"bad-{rank}")], "ValueError: not a digit: '²'")
        # Episodes of two agents, one trajectory each: one end per episode, finished or failed.
        duo = [client.start([rank], task="mpi", group=f"duo-{rank}") for _ in range(2)]
        client.finish_episode(duo[0], 1.0, others=[(duo[1], 0.5)])
        client.fail_episode([client.start([rank], task="mpi", group=f"bad-duo-{rank}") for _ in range(2)],
                            "RuntimeError: the checker crashed")
        if rank == 2:
            # Agent programs' episodes whose generations were routed to rank 1's engine: one ends there, by the
            # scheduler's count (`counts_for`); one comes back home first, and then ends here.
            client.finish_episode(client.start([rank], task="mpi", group="routed"), 1.0, counts_for=1)
            home = client.start([rank], task="mpi", group="routed-home")
            client.generation_came_home(1)
            client.finish_episode(home, 1.0)
        record = client.trajectory(ids[1])
        result["versions"] = record.token_versions().tolist()
        for name, call, error in (
                ("unknown", lambda: client.status("nobody"), UnknownTrajectory),
                ("finished", lambda: client.observe(ids[0], [rank, 0, 0, 9]), TrajectoryFinished),
                ("invalid", lambda: client.take_batch(policy_version=2, num_groups=0), InvalidRequest),
                # One-way calls return at once; their error is logged and counted on the controller.
                ("one-way", lambda: client.add_generated(ids[0], [1], [0.0], 2), TrajectoryFinished)):
            try:
                call()
                result[name] = "no error"
            except error as exc:
                result[name] = [type(exc).__name__, str(exc)]
        if rank == 1:  # rank 1 plays the trainer: wait for the whole group (rank 2's members too)
            batch, deadline = None, time.monotonic() + 60
            while batch is None and time.monotonic() < deadline:
                batch = client.take_batch(policy_version=2, num_groups=1, group_size=4)
                time.sleep(0.01)
            result["batch"] = None if batch is None else [batch.step, sorted(t.id for t in batch.trajectories)]
            result["again"] = client.take_batch(policy_version=2, num_groups=1, group_size=4)
        else:
            time.sleep(1.0)  # an idle client: the server must not spin while it waits
    return result


def main(argv: list[str]) -> None:
    from mpi4py import MPI  # inside main: see sfhpc.data.service

    comm = MPI.COMM_WORLD
    out = Path(argv[0])
    rank = comm.Get_rank()
    result = controller(comm, out) if rank == 0 else agent(comm, rank)
    (out / f"rank-{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
