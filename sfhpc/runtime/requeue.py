"""Whether a job requeues itself: one pure decision, asked by the two places that can requeue.

Two moments can call for ``scontrol requeue``, and each asks `decide` with what it knows:

* the controller, when a stop signal has brought the run to its safe point (checkpoint written, the
  step still up): `Situation.exit_status` is None;
* the step guard (`sfhpc.launch.step_guard`), once the step has ended: `Situation.exit_status` is srun's.

The rules, as ``docs/preemption-and-resume.md`` states them:

* ``USR1``/``USR2`` (the time limit is near, ``scancel --signal``) are the job's own request: after its
  checkpoint the run requeues itself.
* After ``TERM`` Slurm requeues the job (``scontrol requeue``, a node going down) or ends it (``scancel``),
  except a preemption: Slurm 22.05 does not requeue a heterogeneous job that ended inside the preemption's
  grace time, so a run stopped while its job is being preempted requeues itself.
* A failed step (an exit status other than 0 and 2, no signal from outside) requeues its job while the
  job has been restarted fewer than ``launch.max_restarts`` times; a user error (2, or a rank's mark
  saying 2) never does, since a rerun would fail the same way. Once a signal came from outside, Slurm or
  the ranks have decided already.
* ``launch.requeue: false`` never requeues, and outside a Slurm job there is nothing to requeue.
"""

from __future__ import annotations

import dataclasses

from sfhpc.errors import SfhpcError

USER_ERROR = SfhpcError.exit_code  # a rank's one-line user error: a rerun would fail the same way
OWN_REQUESTS = ("SIGUSR1", "SIGUSR2")  # the job's own stop requests (time limit near, scancel --signal)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Situation:
    """The facts a requeue depends on, gathered by the caller (nothing here asks Slurm)."""

    job_id: str | None  # the Slurm job, None outside one
    enabled: bool  # launch.requeue (the step guard: --requeue-on-failure was given)
    signal: str | None = None  # the stop signal seen ("SIGUSR1", ...), None when none came
    exit_status: int | None = None  # the ended step's status; None: the ranks stopped at their safe point
    user_error: bool = False  # a rank reported a user error (its mark says 2)
    restarts: int = 0  # Slurm's restart count of the job (every requeue counts, preemptions too)
    max_restarts: int = 0  # launch.max_restarts: requeues of a failed step while restarts are below it
    preempted: bool = False  # the job is being preempted and still runs (`sfhpc.launch.jobs.preempted_and_running`)


@dataclasses.dataclass(frozen=True)
class Decision:
    """Whether to run ``scontrol requeue`` now, and the one line to say (None: nothing worth saying)."""

    requeue: bool
    line: str | None = None


def decide(s: Situation) -> Decision:
    if s.job_id is None or not s.enabled:
        return Decision(False)
    if s.exit_status is None:
        return _at_safe_point(s)
    return _after_step(s, s.exit_status)


def _at_safe_point(s: Situation) -> Decision:
    if s.signal in OWN_REQUESTS or (s.signal == "SIGTERM" and s.preempted):
        return Decision(True, f"requeueing job {s.job_id} after {s.signal}")
    return Decision(False)  # TERM: Slurm requeues the job itself, or a scancel ends it


def _after_step(s: Situation, status: int) -> Decision:
    if status == 0 or s.signal is not None or status == USER_ERROR or s.user_error:
        return Decision(False)
    if s.restarts >= s.max_restarts:
        return Decision(False, f"the step failed (exit {status}); job {s.job_id} is not requeued: it has been "
                               f"restarted {s.restarts} time(s), launch.max_restarts is {s.max_restarts}")
    return Decision(True, f"the step failed (exit {status}); requeueing job {s.job_id} (restart {s.restarts + 1} "
                          f"of {s.max_restarts}): it resumes from its last checkpoint")
