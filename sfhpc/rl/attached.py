"""Rollout workers of other Slurm jobs in a running run (`sfhpc attach`): the controller's door, and the book of
what each attached worker holds.

A run's MPI world is fixed when it starts. Rollout capacity that frees up later (a backfill window, a
preemptible QOS) joins outside it, as agent hosts do: the controller listens on a TCP port of its own and writes
the address and a key into the run folder (``attach/controller.json``, mode 0600); a worker that can read the
folder connects, says who it is (`Join`) and gets a rank number beyond the world's (`Welcome`). Its connection is
a `SocketLink` that carries the world's control messages and the trajectory manager's requests, so the worker runs
the same command loop as a rollout rank and records every token through the same manager. `RoutedComm` gives
the controller one communicator for both: a message to a rank beyond the world goes over that rank's link.

The worker starts its engine, pulls the current weights from the first trainer's weight server
(`sfhpc.weights.version_server`) and says `Ready`; from then on the scheduler gives it episodes like any
rollout rank (lending, reclaiming and rebalancing included), and every weight update reaches it as a pull.

A worker leaves in one of two ways. Told by its job (preemption, time limit, ``scancel``): it cuts its
generations at a token boundary, records them, and hands its unfinished episodes back (`Leaving`); they continue
elsewhere from their prefix, as a reclaimed rank's do. Without a word (its node died, SIGKILL): its link closes;
its trajectories still open are aborted (kept in the store, never trained) and the episodes it held are played
again elsewhere, so it costs the tokens it generated for them, counted (the `worker-left` event).
This module keeps, per attached rank, the episodes handed to it (`handed`), which is what makes the second way
exact: the trajectory manager's server says which of them ended (`ManagerServer.ended_by_group`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from sfhpc.door import Door, knock, refuse
from sfhpc.errors import SfhpcError
from sfhpc.rl import messages as msg
from sfhpc.runtime.socket_link import ANY, LinkClosed, SocketLink

log = logging.getLogger("sfhpc")
REGISTER_NAME = "controller"
HELLO_TIMEOUT_S = 30.0  # a connection that authenticated but says nothing is dropped after this


@dataclasses.dataclass(frozen=True)
class Arrival:
    """A worker whose engine is up: its rank, who it is, the weights it holds."""

    rank: int
    join: msg.Join
    version: int


@dataclasses.dataclass(frozen=True)
class Departure:
    """A worker that left: with a word (`leaving`), or without one (None: its link closed)."""

    rank: int
    leaving: msg.Leaving | None
    reason: str


def open_attach(recipe: Any, register: Path, first_rank: int) -> AttachedWorkers | None:
    """The controller's door for workers of other jobs, or None where the run cannot take them (said in the
    register, where `sfhpc attach` reads it)."""
    if recipe.attach_refusal is not None:
        refuse(register, REGISTER_NAME, recipe.attach_refusal)
        return None
    return AttachedWorkers(register, first_rank)


class AttachedWorkers:
    """The controller's door for rollout workers of other jobs (see the module); ranks from `first_rank` on."""

    def __init__(self, register: Path, first_rank: int, *, bind: str = "0.0.0.0") -> None:
        self._lock = threading.Lock()
        self._next_rank = first_rank
        self.links: dict[int, SocketLink] = {}  # every attached worker's link, joined or ready
        self.joins: dict[int, msg.Join] = {}
        self.ready: set[int] = set()  # ranks that said Ready (the scheduler's)
        self.handed: dict[int, list[msg.EpisodeTicket]] = {}  # per ready rank: episodes handed and not moved
        self.door = Door(register, REGISTER_NAME, self._welcome, bind=bind)

    def _welcome(self, connection: Connection) -> None:
        if not connection.poll(HELLO_TIMEOUT_S):
            raise TimeoutError(f"no hello within {HELLO_TIMEOUT_S:g} s")
        join = connection.recv()
        if not isinstance(join, msg.Join):
            raise SfhpcError(f"the first message was {type(join).__name__}, not Join")
        with self._lock:
            rank, self._next_rank = self._next_rank, self._next_rank + 1
        connection.send(msg.Welcome(rank))
        link = SocketLink(connection, rank=0, peer=rank, name=f"attached worker {rank}")
        with self._lock:
            self.links[rank], self.joins[rank] = link, join
        log.info("attach: rank %d joined from %s (job %s)", rank, join.node, join.job_id)

    def link(self, rank: int) -> SocketLink | None:
        return self.links.get(rank)

    def arrivals(self) -> list[Arrival]:
        """Workers that said Ready since the last call (each once)."""
        found = []
        with self._lock:
            waiting = [(rank, link) for rank, link in self.links.items() if rank not in self.ready]
        for rank, link in waiting:
            try:
                if link.iprobe(tag=msg.JOIN_TAG):
                    ready = link.recv(tag=msg.JOIN_TAG)
                    self.ready.add(rank)
                    self.handed[rank] = []
                    found.append(Arrival(rank, self.joins[rank], ready.version))
            except LinkClosed:
                self.forget(rank)  # gone before it was ready: it held nothing
        return found

    def departures(self) -> list[Departure]:
        """Ready workers that left since the last call: those that said `Leaving`, and those whose link closed."""
        gone = []
        for rank in sorted(self.ready):
            link = self.links[rank]
            try:
                if not link.iprobe(tag=msg.LEAVE_TAG):
                    continue
                leaving = link.recv(tag=msg.LEAVE_TAG)
                gone.append(Departure(rank, leaving, f"its job signalled {leaving.signal}"))
            except LinkClosed:
                gone.append(Departure(rank, None, f"its connection broke ({link.closed_because})"))
        return gone

    def note_handed(self, rank: int, episodes: tuple[msg.EpisodeTicket, ...]) -> None:
        if rank in self.handed:
            self.handed[rank] += episodes

    def note_moved(self, rank: int, episodes: tuple[msg.EpisodeTicket, ...]) -> None:
        """`episodes` left `rank` alive (released, handed back): they are no longer its to lose."""
        if rank not in self.handed:
            return
        moved = collections.Counter((e.group, e.seed) for e in episodes)
        kept = []
        for episode in self.handed[rank]:
            if moved[(episode.group, episode.seed)] > 0:
                moved[(episode.group, episode.seed)] -= 1
            else:
                kept.append(episode)
        self.handed[rank] = kept

    def forget(self, rank: int) -> list[msg.EpisodeTicket]:
        """`rank` is gone: close its link; returns the episodes handed to it and not moved."""
        with self._lock:
            link = self.links.pop(rank, None)
            self.joins.pop(rank, None)
        self.ready.discard(rank)
        if link is not None:
            link.close()
        return self.handed.pop(rank, [])

    def close(self) -> None:
        self.door.close()
        for rank in list(self.links):
            self.forget(rank)


class RoutedComm:
    """The controller's side of a communicator (the world, or the manager's link) with the attached workers'
    links beside it: a rank beyond the communicator's is reached over its link (see the module)."""

    def __init__(self, comm: Any, attached: AttachedWorkers, *, drop_to_gone: bool = False) -> None:
        """`drop_to_gone`: a message to a worker that left is dropped (the manager's answers: the serving thread
        must not fail for it) instead of raising `LinkClosed` (commands: the controller handles the departure)."""
        self.comm, self.attached, self.drop_to_gone = comm, attached, drop_to_gone
        self.size = comm.Get_size()

    def Get_rank(self) -> int:  # noqa: N802 (mpi4py's names)
        return int(self.comm.Get_rank())

    def Get_size(self) -> int:  # noqa: N802
        return int(self.size)

    def _link(self, rank: int) -> SocketLink:
        link = self.attached.link(rank)
        if link is None:
            raise LinkClosed(f"attached worker {rank} is gone")
        return link

    def send(self, message: Any, dest: int, tag: int = 0) -> None:
        if dest < self.size:
            self.comm.send(message, dest=dest, tag=tag)
            return
        try:
            self._link(dest).send(message, dest, tag)
        except LinkClosed:
            if not self.drop_to_gone:
                raise

    def iprobe(self, source: int = ANY, tag: int = ANY, status: Any = None) -> bool:
        if source != ANY:
            if source < self.size:
                return bool(self.comm.Iprobe(source=source, tag=tag, status=status))
            return self._link(source).iprobe(source, tag, status)
        if self.comm.Iprobe(source=source, tag=tag, status=status):
            return True
        for link in list(self.attached.links.values()):
            try:
                if link.iprobe(ANY, tag, status):
                    return True
            except LinkClosed:
                continue  # a departure the controller's loop handles
        return False

    Iprobe = iprobe

    def recv(self, source: int = ANY, tag: int = ANY) -> Any:
        if source == ANY:
            raise ValueError("a receive from any rank is not routed: probe first, then receive from its source")
        if source < self.size:
            return self.comm.recv(source=source, tag=tag)
        return self._link(source).recv(source, tag)


# -- the worker's side ------------------------------------------------------------------------------------------

def join_run(register: Path, join: msg.Join, *, timeout_s: float = 1800.0) -> SocketLink:
    """Connect to the run whose controller registered in `register` (waiting up to `timeout_s` for it: the worker's
    job may start first); returns the link, whose `rank` is this worker's rank in the run."""
    connection = knock(register, REGISTER_NAME, timeout_s=timeout_s, what="run's controller")
    connection.send(join)
    if not connection.poll(HELLO_TIMEOUT_S):
        raise SfhpcError(f"the run's controller did not answer within {HELLO_TIMEOUT_S:g} s")
    welcome = connection.recv()
    return SocketLink(connection, rank=welcome.rank, peer=0, name="link to the controller")


# -- the controller's side of a command to ranks some of which may be attached workers --------------------------

def send_to(comm: Any, rank: int, command: object) -> bool:
    """Send `command` to `rank`; False when it is an attached worker that left (its departure is handled in the
    controller's loop, `Controller.follow_attached`)."""
    try:
        msg.send(comm, command, rank)
    except LinkClosed:
        return False
    return True


def replies_from(comm: Any, ranks: Any, kind: type, **wait: Any) -> list[Any]:
    """Each rank's reply to a command, skipping attached workers that left meanwhile."""
    replies: list[Any] = []
    for rank in ranks:
        try:
            replies.append(msg.receive_reply(comm, rank, kind, **wait))
        except LinkClosed:
            continue
    return replies


def left_behind(handed: list[msg.EpisodeTicket], given_back: tuple[msg.EpisodeTicket, ...],
                ended: collections.Counter[str | None], in_flight: Any) -> list[msg.EpisodeTicket]:
    """What a departed worker's episodes leave to do: those it gave back (continued from their prefix), and, per
    group still in flight (`in_flight(group)`), the episodes handed to it that neither ended there (`ended`: its
    episode ends by group) nor came back, to play again from the start (`resume_id` cleared: their trajectories
    there were aborted)."""
    again: list[msg.EpisodeTicket] = []
    by_group: dict[str, list[msg.EpisodeTicket]] = {}
    for episode in handed:
        by_group.setdefault(episode.group, []).append(episode)
    back = collections.Counter(e.group for e in given_back)
    for group, episodes in by_group.items():
        missing = len(episodes) - ended[group] - back[group]
        if missing > 0 and in_flight(group):
            again += [dataclasses.replace(e, resume_id=None) for e in episodes[-missing:]]
    return list(given_back) + again
