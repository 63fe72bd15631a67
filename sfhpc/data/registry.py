"""The registry of a run's trajectories: what each one holds and its status, every change also written to
the `TrajectoryStore` when there is one.

It holds the *live* trajectories (running, interrupted, finished) in full and keeps only the status of the
*closed* ones (consumed, stale, aborted, failed). It decides nothing about groups or batches: that is the
`sfhpc.data.groups.GroupBook`'s, and the `sfhpc.data.manager.TrajectoryManager` composes the two under
one lock (neither class is thread-safe on its own).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

import numpy as np

from sfhpc.data import layout
from sfhpc.data.errors import InvalidRequest, TrajectoryExists, TrajectoryFinished, UnknownTrajectory
from sfhpc.data.store import StoreView, TrajectoryStore
from sfhpc.data.trajectory import Segment, Status, Trajectory, branch_of

# Only their status is kept in memory.
CLOSED = (Status.CONSUMED, Status.STALE, Status.ABORTED, Status.FAILED, Status.EVALUATED, Status.FILTERED)


class LiveTrajectory:
    """A trajectory the registry still holds (running, interrupted or finished): mutable, under the lock."""

    __slots__ = ("id", "task", "group", "metadata_json", "created", "updated", "status", "segments", "reward",
                 "turn_rewards", "last_event", "fail_reason", "_context")

    def __init__(self, trajectory: Trajectory) -> None:
        self.id, self.task, self.group = trajectory.id, trajectory.task, trajectory.group
        self.metadata_json = trajectory.metadata_json
        self.created, self.updated = trajectory.created, trajectory.updated
        self.status, self.reward, self.turn_rewards = trajectory.status, trajectory.reward, trajectory.turn_rewards
        self.segments: list[Segment] = list(trajectory.segments)
        self.last_event = trajectory.updated
        self.fail_reason = trajectory.fail_reason
        self._context: np.ndarray | None = None

    @property
    def group_key(self) -> str:
        return self.group if self.group is not None else self.id

    def context(self) -> np.ndarray:
        if self._context is None:
            parts = [self.segments[i].tokens[:used] for i, used in branch_of(self.segments)]
            self._context = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        return self._context

    def append(self, segment: Segment) -> None:
        extends_head = self.segments and segment.parent == len(self.segments) - 1 \
            and segment.fork_at == len(self.segments[-1])
        if extends_head and self._context is not None:
            self._context = np.concatenate([self._context, segment.tokens])
        else:
            self._context = None
        self.segments.append(segment)

    def generated_this_turn(self) -> int:
        """Tokens generated since the last prompt/observation on the current branch."""
        total = 0
        for index, used in reversed(branch_of(self.segments)):
            if not self.segments[index].generated:
                break
            total += used
        return total

    def oldest_version(self) -> int | None:
        """The oldest policy version among the current branch's generated tokens."""
        versions = [int(self.segments[i].versions[:used].min()) for i, used in branch_of(self.segments)
                    if self.segments[i].generated and used]
        return min(versions) if versions else None

    def newest_version(self) -> int | None:
        """The newest policy version among the current branch's generated tokens."""
        versions = [int(self.segments[i].versions[:used].max()) for i, used in branch_of(self.segments)
                    if self.segments[i].generated and used]
        return max(versions) if versions else None

    def generated_tokens(self) -> tuple[int, int]:
        """(the policy's tokens on every branch, those of them on the current branch)."""
        every = sum(len(s.tokens) for s in self.segments if s.generated)
        on_branch = sum(used for i, used in branch_of(self.segments) if self.segments[i].generated)
        return every, on_branch

    def tokens_newer_than(self, version: int) -> int:
        """How many of the current branch's generated tokens a policy newer than `version` produced."""
        return sum(int((self.segments[i].versions[:used] > version).sum()) for i, used in branch_of(self.segments)
                   if self.segments[i].generated and used)

    def snapshot(self) -> Trajectory:
        return Trajectory(id=self.id, segments=tuple(self.segments), task=self.task, group=self.group,
                          status=self.status, reward=self.reward, turn_rewards=self.turn_rewards,
                          metadata_json=self.metadata_json, created=self.created, updated=self.updated,
                          fail_reason=self.fail_reason)


def fork_point(segments: Sequence[Segment], position: int) -> tuple[int, int]:
    """Where a segment continuing the current branch's first `position` tokens attaches: (parent, fork_at).

    At a boundary between two segments it attaches to the end of the earlier one.
    """
    start = 0
    for index, used in branch_of(segments):
        if position <= start + used:
            return index, position - start
        start += used
    raise ValueError(f"position {position} is past the end of the branch ({start} tokens)")


def fits(value: str, limit: int, what: str) -> None:
    if len(value.encode("utf-8")) > limit:
        raise InvalidRequest(f"{what} is longer than {limit} bytes: {value[:40]!r}...")


def check_start(trajectory_id: str, task: str, group: str | None, metadata: dict | None) -> str:
    """Everything `TrajectoryManager.start` refuses but an id clash, checked where the call is made (a
    remote client sends `start` one-way after this); returns the metadata as stored (JSON)."""
    if not trajectory_id:
        raise InvalidRequest("a trajectory id cannot be empty")
    fits(trajectory_id, layout.ID_BYTES, "trajectory id")
    fits(task, layout.TASK_BYTES, "task name")
    if group is not None:
        fits(group, layout.GROUP_BYTES, "group id")
    try:
        return Trajectory.encode_metadata(metadata)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def new_trajectory_id() -> str:
    """A random 128-bit id: no two callers anywhere in a run draw the same one."""
    return uuid.uuid4().hex


class TrajectoryRegistry:
    """The live trajectories and the statuses of the closed ones (see the module); not thread-safe."""

    def __init__(self, store: TrajectoryStore | None = None) -> None:
        self.store = store
        self.live: dict[str, LiveTrajectory] = {}
        self.closed: dict[str, Status] = {}

    def restore(self, view: StoreView) -> list[Trajectory]:
        """Reload what the store holds (`view`, a resumed run); generations that were running are interrupted.
        Returns the failed trajectories (their groups are never trained on)."""
        assert self.store is not None
        failed = []
        for trajectory_id, status in view.statuses().items():
            if status is Status.FAILED:
                failed.append(view.get(trajectory_id))
            if status in CLOSED:
                self.closed[trajectory_id] = status
                continue
            live = LiveTrajectory(view.get(trajectory_id))
            if live.status is Status.RUNNING:  # the engine generating it died with the old process
                live.status, live.updated = Status.INTERRUPTED, time.time()
                self.store.set_status(live.id, live.status, when=live.updated)
            self.live[trajectory_id] = live
        return failed

    # -- lookups ---------------------------------------------------------------------------------------

    def get(self, trajectory_id: str) -> LiveTrajectory:
        live = self.live.get(trajectory_id)
        if live is None:
            if trajectory_id in self.closed:
                raise TrajectoryFinished(f"trajectory {trajectory_id!r} is {self.closed[trajectory_id]}")
            raise UnknownTrajectory(f"no trajectory with id {trajectory_id!r}")
        return live

    def open(self, trajectory_id: str) -> LiveTrajectory:
        """A trajectory that still takes tokens (running or interrupted)."""
        live = self.get(trajectory_id)
        if not live.status.is_open:
            raise TrajectoryFinished(f"trajectory {trajectory_id!r} is {live.status}; it takes no more tokens")
        return live

    def exists(self, trajectory_id: str) -> bool:
        return trajectory_id in self.live or trajectory_id in self.closed

    def status(self, trajectory_id: str) -> Status:
        if trajectory_id in self.closed:
            return self.closed[trajectory_id]
        live = self.live.get(trajectory_id)
        if live is None:
            raise UnknownTrajectory(f"no trajectory with id {trajectory_id!r}")
        return live.status

    def given_up(self, trajectory_id: str) -> bool:
        """Whether the run gave this trajectory up (aborted, failed, or dropped as stale while it still
        played): late recording calls for it are dropped."""
        return self.closed.get(trajectory_id) in (Status.ABORTED, Status.FAILED, Status.STALE)

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys((s.value for s in Status), 0)
        for live in self.live.values():
            counts[live.status] += 1
        for status in self.closed.values():
            counts[status] += 1
        return counts

    # -- changes -----------------------------------------------------------------------------------------

    def start(self, record: Trajectory) -> LiveTrajectory:
        """Hold a new trajectory (its first segment, the prompt, included)."""
        if self.exists(record.id):
            raise TrajectoryExists(f"trajectory id {record.id!r} is already in use")
        live = self.live[record.id] = LiveTrajectory(record)
        if self.store is not None:
            self.store.add_trajectory(record.id, task=record.task, group=record.group,
                                      metadata_json=record.metadata_json, created=record.created)
            self.store.add_segment(record.id, record.segments[0])
        return live

    def add(self, live: LiveTrajectory, segment: Segment) -> None:
        live.append(segment)
        live.last_event = segment.t_end
        if self.store is not None:
            self.store.add_segment(live.id, segment)

    def set_status(self, live: LiveTrajectory, status: Status) -> None:
        live.status, live.updated = status, time.time()
        if self.store is not None and status is Status.FAILED:
            self.store.set_status(live.id, status, when=live.updated, reason=live.fail_reason)
        elif self.store is not None:  # every record carries the rewards: a reader needs only the latest one
            self.store.set_status(live.id, status, when=live.updated, reward=live.reward,
                                  turn_rewards=live.turn_rewards)

    def close(self, live: LiveTrajectory) -> None:
        """Keep only the status of a trajectory that left the live set (its record is in the store)."""
        del self.live[live.id]
        self.closed[live.id] = live.status
