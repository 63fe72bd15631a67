"""The requeue decision as a table: every situation the controller or the step guard meets, and the answer
docs/preemption-and-resume.md gives for it (the step guard's and the Slurm tests run the callers)."""

from __future__ import annotations

import pytest

from sfhpc.runtime.requeue import Decision, Situation, decide

JOB = "77"
FAILED = ("the step failed (exit 3); requeueing job 77 (restart 1 of 3): it resumes from its last checkpoint")

# (situation, requeue, line); a safe point is exit_status None (the controller), an ended step an int (the guard).
TABLE: dict[str, tuple[Situation, bool, str | None]] = {
    # The controller, at a stop signal's safe point.
    "usr1-requeues": (Situation(job_id=JOB, enabled=True, signal="SIGUSR1"), True, "requeueing job 77 after SIGUSR1"),
    "usr2-requeues": (Situation(job_id=JOB, enabled=True, signal="SIGUSR2"), True, "requeueing job 77 after SIGUSR2"),
    "term-left-to-slurm": (Situation(job_id=JOB, enabled=True, signal="SIGTERM"), False, None),
    "term-of-a-preemption-requeues": (Situation(job_id=JOB, enabled=True, signal="SIGTERM", preempted=True), True,
                                      "requeueing job 77 after SIGTERM"),
    "usr1-requeue-off": (Situation(job_id=JOB, enabled=False, signal="SIGUSR1"), False, None),
    "preempted-requeue-off": (Situation(job_id=JOB, enabled=False, signal="SIGTERM", preempted=True), False, None),
    "usr1-on-one-machine": (Situation(job_id=None, enabled=True, signal="SIGUSR1"), False, None),
    "usr1-restarts-do-not-count": (Situation(job_id=JOB, enabled=True, signal="SIGUSR1", restarts=9, max_restarts=3),
                                   True, "requeueing job 77 after SIGUSR1"),
    # The step guard, once the step ended.
    "success": (Situation(job_id=JOB, enabled=True, exit_status=0, max_restarts=3), False, None),
    "failure-requeues": (Situation(job_id=JOB, enabled=True, exit_status=3, max_restarts=3), True, FAILED),
    "failure-last-restart": (Situation(job_id=JOB, enabled=True, exit_status=1, restarts=2, max_restarts=3), True,
                             "the step failed (exit 1); requeueing job 77 (restart 3 of 3): it resumes from its "
                             "last checkpoint"),
    "failure-out-of-restarts": (Situation(job_id=JOB, enabled=True, exit_status=3, restarts=3, max_restarts=3), False,
                                "the step failed (exit 3); job 77 is not requeued: it has been restarted 3 time(s), "
                                "launch.max_restarts is 3"),
    "failure-max-restarts-0": (Situation(job_id=JOB, enabled=True, exit_status=3, max_restarts=0), False,
                               "the step failed (exit 3); job 77 is not requeued: it has been restarted 0 time(s), "
                               "launch.max_restarts is 0"),
    "user-error-status": (Situation(job_id=JOB, enabled=True, exit_status=2, max_restarts=3), False, None),
    "user-error-in-a-mark": (Situation(job_id=JOB, enabled=True, exit_status=1, user_error=True, max_restarts=3),
                             False, None),
    "failure-after-term": (Situation(job_id=JOB, enabled=True, exit_status=143, signal="SIGTERM", max_restarts=3),
                           False, None),
    "failure-after-usr1": (Situation(job_id=JOB, enabled=True, exit_status=75, signal="SIGUSR1", max_restarts=3),
                           False, None),
    "failure-requeue-off": (Situation(job_id=JOB, enabled=False, exit_status=3, max_restarts=3), False, None),
    "failure-outside-a-job": (Situation(job_id=None, enabled=True, exit_status=3, max_restarts=3), False, None),
}


@pytest.mark.parametrize(("situation", "requeue", "line"), TABLE.values(), ids=TABLE.keys())
def test_the_requeue_decision(situation: Situation, requeue: bool, line: str | None) -> None:
    assert decide(situation) == Decision(requeue, line)
