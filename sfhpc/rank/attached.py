"""``python -m sfhpc.rank.attached RUN_DIR [--tags T,...]``: one rollout worker of another job, joined to a running
run (`sfhpc.rl.attached`). ``sfhpc attach`` submits a job that starts one per task.

The worker reads the run's recipe from the run folder, connects to its controller, starts its engine on the run's
model folder, pulls the current weights from the first trainer and says it is ready; then it serves the
controller's commands as a rollout rank does, until the run stops it (exit 0) or its own job ends it: on
SIGTERM, SIGUSR1 or SIGUSR2 (preemption, ``scontrol requeue``, the time limit's warning, ``scancel``) it cuts its
generations at a token boundary, hands its episodes back and exits 0 at once; the run goes on without it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

from sfhpc.errors import SfhpcError
from sfhpc.rundir import RunPaths, recorded_recipe
from sfhpc.runtime import preemption, rank_log
from sfhpc.runtime.slurm_env import current_job_id
from sfhpc.runtime.socket_link import LinkClosed

log = logging.getLogger("sfhpc")


class Leave(Exception):
    """A stop signal reached the worker: it leaves the run (raised from the command loop's idle check)."""

    def __init__(self, signal: str) -> None:
        super().__init__(signal)
        self.signal = signal


class LeaveNotice:
    """The command loop's `notice` on a worker of another job: a signal means leave, not stop the run."""

    def check(self) -> None:
        if (name := preemption.received()) is not None:
            raise Leave(name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sfhpc.rank.attached", description=__doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--tags", default="rollout",
                        help="the capability tags of this worker's nodes, comma-separated (default: rollout)")
    args = parser.parse_args(argv)
    # Outside any MPI world (srun --mpi=none): the modules this worker shares with the ranks use mpi4py's
    # constants only, and MPI must not start (under srun without PMI it would abort the process).
    import mpi4py

    mpi4py.rc.initialize = mpi4py.rc.finalize = False
    preemption.install()  # from the first moment: a signal during start-up makes the worker leave
    try:
        return run_worker(args.run_dir.absolute(), tuple(t for t in args.tags.split(",") if t))
    except SfhpcError as exc:
        print(f"sfhpc attached worker: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except LinkClosed as exc:
        print(f"sfhpc attached worker: the run's controller went away ({exc}); the run has ended or was "
              "requeued", file=sys.stderr, flush=True)
        return 1


def run_worker(run_dir: Path, tags: tuple[str, ...]) -> int:
    from sfhpc.config import load_recipe
    from sfhpc.rl import messages as msg
    from sfhpc.rl.attached import join_run
    from sfhpc.runtime.comm_layout import CommLayout
    from sfhpc.weights.version_server import VersionPuller

    paths = RunPaths(run_dir)
    recorded = recorded_recipe(run_dir)
    if recorded is None:
        raise SfhpcError(f"{run_dir} is not an RL run's folder (no recipe.json)")
    recipe = load_recipe(str(recorded[0]), recorded[1])
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    link = join_run(paths.attach, msg.Join(current_job_id(), node, tags))  # (waits for the run's controller)
    rank = link.rank
    rank_log.set_up(paths.rank_log(rank), rank)
    print(f"sfhpc attached worker: rank {rank} of the run in {run_dir} (node {node})", flush=True)
    layout = CommLayout(world=link, manager_link=link, trainers=None, rollouts=None, weight_broadcast=None,
                        trainer_ranks=(), rollout_ranks=(rank,), broadcast_ranks=())
    worker = _start_worker(recipe, paths, layout, VersionPuller(paths.attach))
    try:
        version = worker.catch_up()
        link.send(msg.Ready(rank, version), 0, msg.JOIN_TAG)
        print(f"sfhpc attached worker: rank {rank} ready at weights version {version}", flush=True)
        from sfhpc.rl.rank_commands import serve

        try:
            serve(layout, rollout=worker, notice=LeaveNotice())
        except Leave as leave:
            interrupted, episodes, _ = worker.reclaim()  # (it routes nothing: no engine doors)
            link.send(msg.Leaving(rank, leave.signal, interrupted, episodes), 0, msg.LEAVE_TAG)
            print(f"sfhpc attached worker: rank {rank} left the run on {leave.signal}: {interrupted} generation(s) "
                  f"cut, {len(episodes)} episode(s) handed back", flush=True)
    finally:
        _close(worker, link)
    return 0


def _start_worker(recipe: Any, paths: RunPaths, layout: Any, puller: Any) -> Any:
    from sfhpc.engine.factory import start_engine
    from sfhpc.engine.tokenizer import load_tokenizer
    from sfhpc.rl.rollout_worker import RolloutWorker
    from sfhpc.tasks.registry import get_task

    rank = layout.world.Get_rank()
    task = get_task(recipe.task, recipe.source)
    return RolloutWorker(recipe, task, layout, lambda: start_engine(recipe, paths.model, rank),
                         tokenizer=load_tokenizer(paths.model), lendable=True, agent_hosts=paths.agent_hosts,
                         model_dir=paths.model, puller=puller)


def _close(worker: Any, link: Any) -> None:
    """The engine and the agents end; the link last (the run may have forgotten this worker already)."""
    with contextlib.suppress(LinkClosed):
        worker.close()
    if worker.puller is not None:
        worker.puller.close()
    link.close()


if __name__ == "__main__":
    sys.exit(main())
