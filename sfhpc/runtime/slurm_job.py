"""A running job, as its own ranks see it: slurmctld's view of the job (state, restarts, a preemption under
way) and the two Slurm calls a rank makes about its own job (``scontrol show job``, ``scontrol requeue``).

It sits below the RL loop, which asks it at a stop's safe point, and below launch, whose job watching
(`sfhpc.launch.jobs`) builds on it; every Slurm client command goes through `slurm_command`.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess

from sfhpc.errors import SfhpcError, SlurmError

# A pending job that only a person can start again (`scontrol release`).
HELD_REASONS = ("job_requeued_in_held_state", "JobHeldUser", "JobHeldAdmin")
HELD_STATES = ("REQUEUE_HOLD", "SPECIAL_EXIT")


def slurm_command(args: list[str], timeout: float = 60) -> str:
    """Run a Slurm client command and return its stdout; one-line SlurmError when it is missing or fails."""
    if shutil.which(args[0]) is None:
        raise SlurmError(f"'{args[0]}' not found on PATH: install the Slurm client tools "
                         "(or start the dev cluster with `make cluster-up`)")
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"'{' '.join(args)}' did not answer within {timeout:.0f} s: is slurmctld up?") from None
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()] or ["(no message)"]
        raise SlurmError(f"'{' '.join(args)}' failed: {lines[-1].strip()}")
    return done.stdout


def check_job_id(job_id: str) -> str:
    if not job_id.isdigit():
        raise SfhpcError(f"'{job_id}' is not a Slurm job id (expected a number such as 1234)")
    return job_id


# When components disagree, the job shows the first of these that any component is in.
_STATE_PRECEDENCE = (
    "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "TIMEOUT", "CANCELLED", "PREEMPTED",
    "REQUEUED", "RUNNING", "COMPLETING", "SUSPENDED", "RESIZING", "PENDING", "COMPLETED",
)


def combine_states(states: list[str]) -> str:
    """One state for a het job from its components' states (e.g. RUNNING + COMPLETED -> RUNNING)."""
    def rank(state: str) -> int:
        word = state.split()[0] if state else "UNKNOWN"
        return _STATE_PRECEDENCE.index(word) if word in _STATE_PRECEDENCE else -1

    return min(states, key=rank) if states else "UNKNOWN"


@dataclasses.dataclass(frozen=True)
class LiveJob:
    """What slurmctld holds on a job now: its state (over every het component), why it waits, its restarts."""

    state: str
    reason: str
    restarts: int
    preempted: bool = False  # a preemption is under way (its grace time runs): slurmctld set PreemptTime

    @property
    def held(self) -> bool:
        return self.state in HELD_STATES or (self.state == "PENDING" and self.reason in HELD_REASONS)


def _field(line: str, key: str) -> str | None:
    match = re.search(rf"(?:^|\s){key}=(\S*)", line)
    return match.group(1) if match else None


def parse_scontrol_job(text: str) -> LiveJob | None:
    """`scontrol show job -o` output (one line per het component) -> LiveJob; None when it names no job."""
    lines = [ln for ln in text.splitlines() if _field(ln, "JobState") is not None]
    if not lines:
        return None
    states = [_field(ln, "JobState") or "" for ln in lines]
    state = combine_states(states)
    reason = next((_field(ln, "Reason") or "" for ln, s in zip(lines, states) if s == state), "")
    restarts = max(int(r) if (r := _field(ln, "Restarts")) and r.isdigit() else 0 for ln in lines)
    preempted = any(_field(ln, "PreemptTime") not in (None, "None", "Unknown") for ln in lines)
    return LiveJob(state, reason, restarts, preempted)


def live_job(job_id: str) -> LiveJob | None:
    """The job as slurmctld sees it now, or None once slurmctld has forgotten it (or cannot be asked)."""
    try:
        return parse_scontrol_job(slurm_command(["scontrol", "show", "job", "-o", check_job_id(job_id)]))
    except SlurmError:  # "Invalid job id specified": ended more than MinJobAge ago
        return None


def preempted_and_running(job_id: str) -> bool:
    """The job is being preempted and still runs. Slurm 22.05 requeues a preempted heterogeneous job only
    if it is still running when the preemption's grace time ends: one that stopped cleanly inside the grace
    (after its checkpoint) ends for good, so it must requeue itself. A job that `scontrol requeue` or
    `scancel` is ending is COMPLETING instead, and is left alone."""
    live = live_job(job_id)
    return live is not None and live.state == "RUNNING" and live.preempted


def requeue_job(job_id: str) -> None:
    """Put a running job back in the queue (``scontrol requeue``): Slurm ends the current run (TERM, then
    KILL after KillWait) and starts the job again, which resumes from its last checkpoint."""
    slurm_command(["scontrol", "requeue", check_job_id(job_id)])
