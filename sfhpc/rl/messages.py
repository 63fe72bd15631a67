"""What the controller and the workers say to each other over the world communicator.

The controller sends commands; workers answer only where the controller waits for an answer. Every
message is a small frozen dataclass sent with mpi4py's pickle-based ``send`` under `CONTROL_TAG`; the
trajectory data itself travels through the trajectory manager's own communicator, weights through the
weight-broadcast communicator.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, TypeVar

from sfhpc.tasks.base import Problem

CONTROL_TAG = 0x5F20
REPLY_TAG = 0x5F21
R = TypeVar("R")


@dataclasses.dataclass(frozen=True)
class EpisodeTicket:
    """The controller's order to play one episode: a problem, its GRPO group and a sampling seed. (The
    episode itself, the environment's side of it, is the task's `sfhpc.tasks.base.Episode`.)"""

    problem: Problem
    group: str
    seed: int
    resume_id: str | None = None  # continue this trajectory of an earlier allocation instead of a new one


@dataclasses.dataclass(frozen=True)
class Play:
    """Controller -> rollout rank: play these episodes (they finish in the trajectory manager)."""

    episodes: tuple[EpisodeTicket, ...]


@dataclasses.dataclass(frozen=True)
class Train:
    """Controller -> every trainer rank: one optimisation step (trainer 0 answers `Trained`).

    Only the first trainer's command carries the batch (a `sfhpc.trainer.batch.TrainBatch`); it broadcasts
    the batch over the trainers' communicator, and the other trainers' commands carry None.
    """

    step: int
    batch: Any | None


@dataclasses.dataclass(frozen=True)
class Trained:
    step: int
    version: int
    metrics: dict[str, float | int]


@dataclasses.dataclass(frozen=True)
class SyncWeights:
    """Controller -> trainers and rollout ranks: bring the engines to `version` (each rank answers `Synced`).

    Disaggregated: the first trainer broadcasts, rollout ranks pause, receive, load and resume.
    Colocated: every rank loads its own trainer's weights into its own engine.
    """

    version: int


@dataclasses.dataclass(frozen=True)
class Synced:
    rank: int
    version: int
    seconds: float
    bytes: int = 0  # the publishing trainer's: the version's bytes on the wire (a delta's, with engine.weight_delta)
    restarts: int = 0  # a rollout rank's: its engine's restarts so far in this allocation (engine.max_restarts)
    paused_at: float = 0.0  # a rollout rank's: when its engine paused for this version (wall clock, `seconds` long)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """Controller -> trainer ranks: write a checkpoint at `path` (trainer 0 answers `CheckpointWritten`)."""

    path: str


@dataclasses.dataclass(frozen=True)
class CheckpointWritten:
    rank: int
    path: str
    version: int  # the policy version the checkpoint holds


@dataclasses.dataclass(frozen=True)
class Quiesce:
    """Controller -> rollout ranks, at a stop request's safe point: pause the engine, so that every
    generation in flight ends and is recorded as a partial rollout; answer `Quiesced` once the records
    have reached the trajectory manager. The engine stays paused until Stop."""


@dataclasses.dataclass(frozen=True)
class Quiesced:
    rank: int
    interrupted: int  # generations this rank cut short


@dataclasses.dataclass(frozen=True)
class Reclaim:
    """Controller -> a trainer rank lent to rollout, when the batch is ready: cut its generations at a token
    boundary (recorded as partial rollouts), drop its episodes and answer `Reclaimed` with them, so that
    they continue elsewhere; the engine stays loaded for the next lending. An agent program's episode stays
    (its program cannot move): its generation goes to a rank of `to`, taken in turn (`sfhpc.engine.remote`)."""

    to: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Reclaimed:
    rank: int
    interrupted: int  # generations cut short
    episodes: tuple[EpisodeTicket, ...]  # its unfinished episodes (``resume_id`` set where a trajectory started)
    routed: tuple[int, ...] = ()  # per agent program's episode kept here: the rank its generation went to


@dataclasses.dataclass(frozen=True)
class Release:
    """Controller -> a loaded rollout rank while a lent rank ran dry (``seamless`` rebalancing): cut up to
    `episodes` of its episodes now generating, those handed out first (the oldest groups), at a token
    boundary (recorded as partial rollouts) and answer `Released` with them, to continue elsewhere. Agent
    programs' episodes among them stay, their generations routed to the ranks of `to` in turn (as `Reclaim`)."""
    episodes: int
    to: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Released:
    rank: int
    episodes: tuple[EpisodeTicket, ...]  # each with ``resume_id``: the trajectory to continue from its prefix
    routed: tuple[int, ...] = ()  # per agent program's episode kept here: the rank its generation went to


@dataclasses.dataclass(frozen=True)
class Cancel:
    """Controller -> every rank that plays episodes: these groups were dropped as stale while they still
    played (`TrajectoryManager.drop_hopeless`); stop their episodes and answer `Cancelled`."""
    groups: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Cancelled:
    rank: int
    episodes: int  # episodes of those groups that were still playing here, now stopped
    routed: tuple[int, ...] = ()  # of those, the agent programs' whose generations had gone: where each had gone


@dataclasses.dataclass(frozen=True)
class Score:
    """Controller -> a teacher rank (``algorithm.distill``): the teacher's log-probability of every token of
    these rows (a `sfhpc.trainer.batch.TrainBatch`, at each token's sampling temperature); answer `Scored`."""

    step: int
    batch: Any


@dataclasses.dataclass(frozen=True)
class Scored:
    rank: int
    logprobs: Any  # float32 numpy array [rows, length], 0 at position 0 and after each row's end
    seconds: float


@dataclasses.dataclass(frozen=True)
class Join:
    """A rollout worker of another job -> the controller, first over its link (`sfhpc.rl.attached`): who it is."""

    job_id: str | None
    node: str
    tags: tuple[str, ...]  # its node's capability tags (the worker's partition's, by the cluster map)


@dataclasses.dataclass(frozen=True)
class Welcome:
    """Controller -> a joining worker: the rank it has in this run (beyond the MPI world's)."""

    rank: int


@dataclasses.dataclass(frozen=True)
class Ready:
    """A joined worker -> the controller (tag `JOIN_TAG`): its engine is up and holds weights `version`; from now
    on it takes episodes and every command a rollout rank takes."""

    rank: int
    version: int


@dataclasses.dataclass(frozen=True)
class Leaving:
    """A joined worker -> the controller (tag `LEAVE_TAG`), unasked, when its job is ending (preemption, time
    limit, scancel): its generations were cut at a token boundary and recorded; its unfinished episodes, each
    naming its trajectory (``resume_id``) where one started, continue elsewhere. The worker is gone after it."""

    rank: int
    signal: str
    interrupted: int
    episodes: tuple[EpisodeTicket, ...]


JOIN_TAG = 0x5F24
LEAVE_TAG = 0x5F25


@dataclasses.dataclass(frozen=True)
class Stop:
    """Controller -> everyone: the run is over; close down (rollout ranks abandon unplayed episodes)."""


# Each command's reply, from the ranks that answer it (None: no rank answers).
REPLIES: dict[type, type | None] = {
    Play: None, Train: Trained, SyncWeights: Synced, Checkpoint: CheckpointWritten, Quiesce: Quiesced,
    Reclaim: Reclaimed, Release: Released, Cancel: Cancelled, Score: Scored, Stop: None,
}


def send(comm: Any, message: object, dest: int, tag: int = CONTROL_TAG) -> None:
    comm.send(message, dest=dest, tag=tag)


def receive(comm: Any, source: int | None = None, tag: int = CONTROL_TAG, timeout: float | None = None,
            idle: Callable[[], object] | None = None) -> Any:
    """Receive one message, polling with a short sleep (a blocking receive in Open MPI spins a core);
    `idle` is called between polls (a worker passes on a stop signal while it waits)."""
    from mpi4py import MPI

    source = MPI.ANY_SOURCE if source is None else source
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 50e-6
    while not comm.iprobe(source=source, tag=tag):
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"no message with tag {tag:#x} within {timeout} s")
        if idle is not None:
            idle()
        time.sleep(delay)
        delay = min(delay * 2, 2e-3)
    return comm.recv(source=source, tag=tag)


def receive_reply(comm: Any, source: int, kind: type[R], timeout: float | None = None,
                  idle: Callable[[], object] | None = None) -> R:
    """The reply of rank `source` to a command, which must be a `kind` (see `REPLIES`)."""
    reply = receive(comm, source, REPLY_TAG, timeout=timeout, idle=idle)
    if not isinstance(reply, kind):
        raise RuntimeError(f"rank {source} answered {reply!r} where a {kind.__name__} was due")
    return reply


def poll(comm: Any, source: int, tag: int = CONTROL_TAG) -> Any | None:
    """One message if one is waiting, else None (never blocks)."""
    if comm.iprobe(source=source, tag=tag):
        return comm.recv(source=source, tag=tag)
    return None
