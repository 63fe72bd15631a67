"""The program every rank runs: learn who it is, join the MPI world, do the recipe's work.

`RankProgram` is what `sfhpc launch` hands to submitit (it is pickled into the job folder) and what
``python -m sfhpc.rank`` (sbatch templates, ``sfhpc run``) builds from the recipe on each rank. Every
run starts with the launch report; a *probe* (``sfhpc probe``, ``--probe``) is that report alone: where
the ranks landed, proven over MPI, with no RL and no task.

From the moment a rank has joined the MPI world, whatever goes wrong on it ends every rank through the
one fault path (`sfhpc.runtime.fault`), and an RL run keeps every rank's heartbeat
(`sfhpc.runtime.liveness`). Before that (a recipe a rank cannot read), each rank reports on its own
(`report_user_error`, `run_rank_main`): no rank waits for another yet.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from sfhpc.config.recipe import Recipe
from sfhpc.errors import SfhpcError
from sfhpc.plan.launch_plan import LaunchPlan
from sfhpc.rundir import RunPaths
from sfhpc.runtime import fault, fault_injection, liveness, preemption, rank_log, step_marks
from sfhpc.runtime.gpu_binding import bind_one_gpu
from sfhpc.runtime.identity import RankIdentity, identify
from sfhpc.runtime.report import launch_report
from sfhpc.runtime.slurm_env import PLAN_SHOWN_VAR, read_rank_environment

log = logging.getLogger("sfhpc")


@dataclasses.dataclass(frozen=True)
class RankProgram:
    recipe: Recipe
    plan: LaunchPlan
    run_dir: Path
    probe: bool = False  # the launch report only (sfhpc probe)
    verbose: bool = False  # the libraries' INFO lines on the console too, not only in the rank's log

    def __call__(self) -> dict[str, Any]:
        preemption.install()  # from the first moment: a stop signal during start-up is acted on, not lost
        identity = identify(self.plan, read_rank_environment())
        step_marks.arm(identity.rank)
        try:
            # Before CUDA starts: a GPU rank that Slurm left seeing every GPU of its node takes its own.
            bind_one_gpu(self.plan.components[identity.env.component], identity.env)
            result = self._run(identity)
        except SfhpcError as exc:  # a user error's mark keeps the step guard from requeueing the job
            step_marks.finished(exc.exit_code)
            raise
        step_marks.finished(0)
        return result

    def _run(self, identity: RankIdentity) -> dict[str, Any]:
        log_path = RunPaths(self.run_dir).rank_log(identity.rank)
        rank_log.set_up(log_path, identity.rank, verbose=self.verbose)  # before anything imports vLLM
        # Import mpi4py here, never at module level: vLLM's CPU engine spawns children that re-import
        # the main module, and a top-level import would run MPI_Init in them. The import joins the world.
        from mpi4py import MPI  # noqa: F401

        with fault.armed(identity.rank, fault.describe_rank(identity.rank, identity.roles, identity.env.node),
                         log_path):
            return self._in_world(identity)

    def _in_world(self, identity: RankIdentity) -> dict[str, Any]:
        from mpi4py import MPI

        from sfhpc.runtime.mpi_threads import check_thread_level

        check_thread_level(MPI.Query_thread(), MPI.THREAD_MULTIPLE)  # ranks call MPI from several threads
        comm = MPI.COMM_WORLD
        if comm.Get_size() != identity.env.world_size or comm.Get_rank() != identity.rank:
            raise SfhpcError(
                f"MPI sees rank {comm.Get_rank()} of {comm.Get_size()} but the launcher says "
                f"{identity.rank} of {identity.env.world_size}: start ranks with srun --mpi=pmix or mpiexec")
        log.info("rank %d: component %d, node %s, roles %s, tags %s", identity.rank, identity.env.component,
                 identity.env.node, ",".join(identity.roles), ",".join(identity.tags))
        if identity.rank == 0 and not os.environ.get(PLAN_SHOWN_VAR):  # the job's log; `sfhpc run` printed it
            print(self.plan.describe(), flush=True)
        # Every run starts with the launch report: who runs where, proven by one Allgather over the world.
        ranks = launch_report(identity, comm, self.run_dir)
        if self.probe:
            return ranks[identity.rank]
        from sfhpc.rl.program import run_rl

        labels = {r["rank"]: fault.describe_rank(r["rank"], r["roles"], r["node"]) for r in ranks}
        with liveness.watched(comm, labels, self.recipe.budgets.heartbeat_timeout_s):
            fault_injection.strike("start", identity.rank)  # a test makes every rank fail here
            return run_rl(identity, comm, self.plan, self.recipe, self.run_dir)


def report_user_error(exc: SfhpcError, is_rank_zero: bool) -> int:
    """Print a user error once (rank 0) and return the exit code every rank should use.

    Every rank usually hits the same error. Other ranks wait a moment before exiting, because srun's
    --kill-on-bad-exit would otherwise kill rank 0 before its message is out.
    """
    if is_rank_zero:
        print(f"sfhpc: error: {exc}", file=sys.stderr, flush=True)
    else:
        time.sleep(fault.OTHER_RANKS_DELAY_S)
    return exc.exit_code


def run_rank_main(program: RankProgram, is_rank_zero: bool) -> int:
    """Run `program`; an error before the rank joined the MPI world (after that, `sfhpc.runtime.fault` takes
    over) becomes one line, printed once by rank 0, and exit code 2, or a traceback and exit code 1."""
    try:
        program()
    except SfhpcError as exc:
        step_marks.finished(exc.exit_code)
        return report_user_error(exc, is_rank_zero)
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        return fault.FAULT_EXIT
    return 0
