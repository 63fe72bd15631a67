"""The trajectory manager, reached by other ranks over MPI.

The manager lives on the controller rank. A `ManagerServer` there answers requests; on every other rank a
`ManagerClient` offers the manager's methods and forwards each call:

    request  (client -> server, tag REQUEST_TAG): (method name, args, kwargs, wants_reply)
    reply    (server -> client, tag REPLY_TAG):   ("ok", result) or ("error", error class name, message)

Recording calls that return nothing (`add_generated`, `interrupt`, `finish`, `fail`) are one-way: the client
does not wait for an answer. So is `start` when the client makes the trajectory id itself (the usual
case: a random 128-bit id, with every other check done before sending), which makes an agent's first
turn cost no round trip at all; a later turn costs one (`observe`). MPI keeps the messages of
one client in order, so a later call still sees their effect. Nobody waits for the answer of a one-way
call, so its error would go unseen: the server logs and counts it (`ManagerServer.failed_one_way`) and
keeps the first one (`first_one_way_failure`), which the controller turns into the error that stops the
run. The server also notes when it last heard from each client rank (`last_seen`), which tells a hung
rollout rank from a slow one.
    goodbye  (client -> server, tag REQUEST_TAG): (GOODBYE, (), {}); no reply

Errors come back as the same `SfhpcError` subclass (UnknownTrajectory stays UnknownTrajectory), so code
on a rollout rank handles them as if the manager were local. Both sides wait with non-blocking probes and
a short sleep: a blocking receive in Open MPI spins a whole core, and this machine has two.

Give the service a communicator of its own (the layout's controller link) or at least keep its tags free.
mpi4py is imported inside functions: a module-level import would run MPI_Init in processes that vLLM's
CPU engine spawns (see the runtime).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import numbers
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from sfhpc.data.errors import WIRE_ERRORS, ServiceError
from sfhpc.data.manager import Batch, Continuation, TrajectoryManager, check_start, new_trajectory_id
from sfhpc.data.trajectory import Trajectory
from sfhpc.errors import SfhpcError

log = logging.getLogger("sfhpc")

REQUEST_TAG = 0x5F10
REPLY_TAG = 0x5F11
GOODBYE = "__goodbye__"
ONE_WAY = frozenset({"add_generated", "interrupt", "finish", "fail", "finish_episode", "fail_episode"})
# The calls that end an episode, exactly one per episode whatever the number of its trajectories (several
# agents, or a call that asked for n > 1 choices): a rank's running episodes are counted by them.
EPISODE_ENDS = frozenset({"finish_episode", "fail_episode"})
# An episode end may count for another rank than the one that reports it: an agent program's episode whose
# generation was routed to another rank's engine (`sfhpc.engine.remote`) is in flight there, by the
# scheduler's count, while its program reports the end from its own rank.
COUNTS_FOR = "counts_for"
# ... until its generation comes back to the program's own rank (the other rank was taken back): from then on it
# is in flight where its program is. (client -> server: (CAME_HOME, (that rank,), {}); one-way, no reply.)
CAME_HOME = "__came_home__"

# What a client may call: the manager's public API, nothing else (no attribute access over the wire).
METHODS = frozenset({
    "start", "exists", "status", "context", "observe", "add_generated", "interrupt", "interrupt_all",
    "continuation", "finish", "fail", "finish_episode", "fail_episode", "abort", "take_batch", "trajectory", "ids",
    "counts", "flush",
})

_MIN_SLEEP, _MAX_SLEEP = 50e-6, 2e-3  # poll back-off: quick answers stay quick, idle waits cost no CPU


def _wait_for(probe: Callable[[], bool], timeout: float | None = None) -> bool:
    """Poll `probe` with an exponential back-off sleep; False if `timeout` seconds pass first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = _MIN_SLEEP
    while not probe():
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, _MAX_SLEEP)
    return True


@dataclasses.dataclass(frozen=True)
class OneWayFailure:
    """A one-way call that failed on the controller (its caller never learns of it)."""

    rank: int
    method: str
    message: str


class ManagerServer:
    """Serves a `TrajectoryManager` on this rank to the `clients` ranks of `comm` (default: all others)."""

    def __init__(self, manager: TrajectoryManager, comm: Any, *, clients: Iterable[int] | None = None) -> None:
        from mpi4py import MPI  # see the module docstring

        self.manager, self.comm, self._mpi = manager, comm, MPI
        rank = comm.Get_rank()
        self.open_clients = set(range(comm.Get_size())) - {rank} if clients is None else set(clients)
        self.served = 0
        self.failed_one_way = 0
        self.first_one_way_failure: OneWayFailure | None = None
        self.last_seen: dict[int, float] = {}  # client rank -> time.monotonic() of its latest request
        self.episodes_ended: dict[int, int] = {}  # client rank -> episodes it reported as ended (finish, fail)
        # Per client rank in `followed` (those that may vanish: rollout workers of other jobs, `sfhpc.rl.attached`):
        # the trajectories it started (or continued) and has not ended, with their groups, and its episodes that
        # ended, by group: what such a worker leaves behind.
        self.followed: set[int] = set()
        self.open_trajectories: dict[int, dict[str, str | None]] = {}
        self.ended_by_group: dict[int, collections.Counter[str | None]] = {}
        # Called with the client's rank after each episode end is counted (the scheduler's timeline hears of
        # an idle rollout rank at once); it runs on the serving thread.
        self.on_episode_end: Callable[[int], object] | None = None

    def _handle(self, source: int, request: Any) -> None:
        self.last_seen[source] = time.monotonic()
        try:
            method, args, kwargs, wants_reply = request
        except (TypeError, ValueError):
            self.comm.send(("error", "ServiceError", f"malformed request from rank {source}"), dest=source,
                           tag=REPLY_TAG)
            return
        if method == GOODBYE:
            self.open_clients.discard(source)
            return
        if method == CAME_HOME:
            self._came_home(source, int(args[0]))
            return
        counted = kwargs.pop(COUNTS_FOR, None) if method in EPISODE_ENDS and isinstance(kwargs, dict) else None
        counted = source if counted is None else int(counted)
        try:
            if method not in METHODS:
                raise ServiceError(f"the trajectory manager has no method {method!r}")
            reply: tuple[Any, ...] = ("ok", getattr(self.manager, method)(*args, **kwargs))
        except SfhpcError as exc:
            reply = ("error", type(exc).__name__, str(exc))
        except Exception as exc:  # a bug must not take the controller down with it; the caller sees it
            log.exception("trajectory manager failed on %s from rank %d", method, source)
            reply = ("error", "ServiceError", f"{method} failed on the controller: {type(exc).__name__}: {exc}")
        self.served += 1
        if reply[0] == "ok" and source in self.followed:
            self._follow(source, method, args, kwargs, reply[1])
        if method in EPISODE_ENDS:
            self.episodes_ended[counted] = self.episodes_ended.get(counted, 0) + 1
            if self.on_episode_end is not None:
                try:
                    self.on_episode_end(counted)
                except Exception:  # bookkeeping: the caller's reply must still go out
                    log.exception("the episode-end hook failed for rank %d", counted)
        if wants_reply:
            self.comm.send(reply, dest=source, tag=REPLY_TAG)
        elif reply[0] == "error":
            self.failed_one_way += 1
            if self.first_one_way_failure is None:
                self.first_one_way_failure = OneWayFailure(source, method, reply[2])
            log.error("one-way %s from rank %d failed: %s", method, source, reply[2])

    def _came_home(self, source: int, rank: int) -> None:
        """An episode of `source` counted in flight on `rank` (`COUNTS_FOR`) is in flight on `source` again: it
        leaves `rank`'s count as if it ended there, and its end will count for `source`."""
        self.episodes_ended[rank] = self.episodes_ended.get(rank, 0) + 1
        self.episodes_ended[source] = self.episodes_ended.get(source, 0) - 1
        if self.on_episode_end is not None:
            try:
                self.on_episode_end(rank)
            except Exception:  # bookkeeping
                log.exception("the episode-end hook failed for rank %d", rank)

    def _follow(self, source: int, method: str, args: Any, kwargs: Any, result: Any) -> None:
        """Keep `open_trajectories` and `ended_by_group` of `source` after a call that succeeded."""
        opened = self.open_trajectories.setdefault(source, {})
        if method == "start":
            opened[result] = kwargs.get("group")
        elif method in ("finish", "fail", "abort"):
            opened.pop(args[0], None)
        elif method in ("observe", "add_generated", "continuation") and args[0] not in opened:
            opened[args[0]] = self.manager.trajectory(args[0]).group  # continued here, started elsewhere
        elif method in EPISODE_ENDS:
            ids = [args[0], *(other for other, _ in kwargs.get("others") or ())] if method == "finish_episode" \
                else list(args[0])
            group = opened.get(ids[0]) if ids else None
            for tid in ids:
                opened.pop(tid, None)
            self.ended_by_group.setdefault(source, collections.Counter())[group] += 1

    def serve_pending(self, max_requests: int = 64) -> int:
        """Answer the requests that have already arrived (at most `max_requests`); returns how many.

        For a controller loop that does other work between polls.
        """
        status = self._mpi.Status()
        handled = 0
        while handled < max_requests and self.comm.Iprobe(source=self._mpi.ANY_SOURCE, tag=REQUEST_TAG,
                                                          status=status):
            source = status.Get_source()
            self._handle(source, self.comm.recv(source=source, tag=REQUEST_TAG))
            handled += 1
        return handled

    def serve(self, stop: Callable[[], bool] | threading.Event | None = None) -> None:
        """Serve until every client has said goodbye or `stop` is set (an Event or a callable)."""
        should_stop = stop.is_set if isinstance(stop, threading.Event) else stop
        delay = _MIN_SLEEP
        while self.open_clients and not (should_stop is not None and should_stop()):
            if self.serve_pending():
                delay = _MIN_SLEEP
            else:
                time.sleep(delay)
                delay = min(delay * 2, _MAX_SLEEP)


class ManagerClient:
    """The trajectory manager's API on a rank that is not the controller; calls are forwarded over MPI.

    Thread-safe: calls from several threads are sent one at a time.
    """

    def __init__(self, comm: Any, server_rank: int = 0, *, timeout: float | None = None) -> None:
        from mpi4py import MPI  # see the module docstring

        self.comm, self.server_rank, self.timeout, self._mpi = comm, server_rank, timeout, MPI
        self._lock = threading.Lock()
        self._closed = False

    def _call(self, method: str, *args: Any, one_way: bool = False, **kwargs: Any) -> Any:
        with self._lock:
            if self._closed:
                raise ServiceError("this trajectory-manager client was closed")
            wants_reply = not one_way and method not in ONE_WAY
            self.comm.send((method, args, kwargs, wants_reply), dest=self.server_rank, tag=REQUEST_TAG)
            if not wants_reply:
                return None
            arrived = _wait_for(lambda: self.comm.Iprobe(source=self.server_rank, tag=REPLY_TAG), self.timeout)
            if not arrived:
                raise ServiceError(f"the trajectory manager on rank {self.server_rank} did not answer {method} "
                                   f"within {self.timeout:g} s; is the controller serving?")
            reply = self.comm.recv(source=self.server_rank, tag=REPLY_TAG)
        if reply[0] == "ok":
            return reply[1]
        _, name, message = reply
        raise WIRE_ERRORS.get(name, ServiceError)(message)

    def close(self) -> None:
        """Tell the server this rank is done (it stops serving once every client has)."""
        with self._lock:
            if not self._closed:
                self.comm.send((GOODBYE, (), {}, False), dest=self.server_rank, tag=REQUEST_TAG)
                self._closed = True

    def __enter__(self) -> ManagerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # The manager's API, forwarded (see TrajectoryManager for what each does).

    def start(self, prompt_tokens: Sequence[int], *, task: str = "", group: str | None = None,
              metadata: dict | None = None, trajectory_id: str | None = None) -> str:
        # An id made here cannot clash, so the call goes one-way once the other checks pass; the caller's
        # own id may clash: then wait for the manager's word.
        one_way = trajectory_id is None
        if trajectory_id is None:
            trajectory_id = new_trajectory_id()
            check_start(trajectory_id, task, group, metadata)
        started = self._call("start", list(prompt_tokens), task=task, group=group, metadata=metadata,
                             trajectory_id=trajectory_id, one_way=one_way)
        return trajectory_id if one_way else started

    def exists(self, trajectory_id: str) -> bool:
        return self._call("exists", trajectory_id)

    def status(self, trajectory_id: str) -> str:
        return self._call("status", trajectory_id)

    def context(self, trajectory_id: str) -> list[int]:
        return self._call("context", trajectory_id)

    def trajectory(self, trajectory_id: str) -> Trajectory:
        return self._call("trajectory", trajectory_id)

    def observe(self, trajectory_id: str, prompt_tokens: Sequence[int]) -> None:
        self._call("observe", trajectory_id, list(prompt_tokens))

    def add_generated(self, trajectory_id: str, tokens: Sequence[int], logprobs: Sequence[float],
                      versions: int | Sequence[int], *, engine: str = "", finish_reason: str | None = None,
                      started_at: float | None = None, temperature: float | None = None,
                      top_p: float | None = None) -> None:
        self._call("add_generated", trajectory_id, list(tokens), list(logprobs),
                   # (int: what a type checker narrows on; numbers.Integral: numpy's integers too)
                   int(versions) if isinstance(versions, int | numbers.Integral) else list(versions), engine=engine,
                   finish_reason=finish_reason, started_at=started_at, temperature=temperature, top_p=top_p)

    def interrupt(self, trajectory_id: str) -> None:
        self._call("interrupt", trajectory_id)

    def interrupt_all(self) -> list[str]:
        return self._call("interrupt_all")

    def continuation(self, trajectory_id: str, max_new_tokens: int) -> Continuation:
        return self._call("continuation", trajectory_id, max_new_tokens)

    def finish(self, trajectory_id: str, reward: float | None = None, *,
               turn_rewards: Sequence[float] | None = None) -> None:
        self._call("finish", trajectory_id, reward, turn_rewards=None if turn_rewards is None else list(turn_rewards))

    def fail(self, trajectory_id: str, reason: str) -> None:
        self._call("fail", trajectory_id, reason)

    def finish_episode(self, trajectory_id: str, reward: float | None = None, *,
                       turn_rewards: Sequence[float] | None = None,
                       others: Sequence[tuple[str, float | None]] = (), counts_for: int | None = None) -> None:
        """`counts_for`: the rank whose episode this was by the scheduler's count (`COUNTS_FOR`), if not this one."""
        self._call("finish_episode", trajectory_id, reward,
                   turn_rewards=None if turn_rewards is None else list(turn_rewards),
                   others=[(other, reward) for other, reward in others], **_counted(counts_for))

    def fail_episode(self, trajectory_ids: Sequence[str], reason: str, *, counts_for: int | None = None) -> None:
        self._call("fail_episode", list(trajectory_ids), reason, **_counted(counts_for))

    def generation_came_home(self, rank: int) -> None:
        """An episode of this rank counted for `rank` (its generation was routed there) is in flight here again
        (`CAME_HOME`); its end will count for this rank."""
        self._call(CAME_HOME, rank, one_way=True)

    def abort(self, trajectory_id: str) -> None:
        self._call("abort", trajectory_id)

    def take_batch(self, policy_version: int, num_groups: int, group_size: int | None = None,
                   step: int | None = None) -> Batch | None:
        return self._call("take_batch", policy_version, num_groups, group_size, step)

    def ids(self, status: str | None = None) -> list[str]:
        return self._call("ids", status)

    def counts(self) -> dict[str, int]:
        return self._call("counts")

    def flush(self) -> None:
        self._call("flush")


def _counted(counts_for: int | None) -> dict[str, Any]:
    return {} if counts_for is None else {COUNTS_FOR: counts_for}
