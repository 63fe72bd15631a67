"""The trajectory manager: the controller's live view of every trajectory, and the source of batches.

Agents' LLM calls pass through it (via the agent endpoint or the MPI service): a trajectory is started
with its prompt, each new turn's full prompt is `observe`d, generated tokens are added with their
logprobs and per-token policy versions, and `finish` closes it with a reward. When generation must stop
(a weight update, a rank taken back for training, a preemption) the trajectory is `interrupt`ed and keeps
its prefix; `continuation` tells the next engine what to feed and how many tokens are left.

An episode whose agent or task raised, or ran out of time, is `fail`ed with the reason. A failed
trajectory is never trained on, and neither is the rest of its GRPO group (GRPO needs whole groups):
members already finished are aborted at once, the others as they end, so the group never waits for a
batch. Recording calls that arrive for a trajectory the run gave up (aborted or failed) are dropped: a
turn that was still generating when its episode failed may still report its tokens.

`take_batch` hands the trainer whole GRPO groups whose tokens are fresh enough and records, in memory and
in the store, which step consumed them, so nothing is trained on twice, also across a restart. Fresh means
neither more than ``max_staleness`` versions older than the policy being trained, nor newer than it (a
token newer than the policy came from weights a restart lost).

The manager also keeps the book of GRPO groups in flight: `book_group` when the controller hands a group
out, and the group leaves the book when it is trained on, dropped as stale, or spoiled by a failed member.
The controller hands out work by `groups_in_flight`, so no count of its own can drift from what the
manager holds. A group key the run ever used (in this process or in the store) is never booked again: the
members of two hand-outs can never meet in one group, also after a crash lost the controller's state.

Every record also goes to the `TrajectoryStore` (if one is given), which is flushed every `flush_every`
finished trajectories, at every batch, and on `flush()`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from sfhpc.data import layout
from sfhpc.data.errors import InvalidRequest, TrajectoryExists, TrajectoryFinished, UnknownTrajectory
from sfhpc.data.rank_intervals import RankInterval
from sfhpc.data.store import TrajectoryStore
from sfhpc.data.trajectory import Segment, SegmentKind, Status, Trajectory, branch_of, episode_of


@dataclasses.dataclass(frozen=True)
class Continuation:
    """How to resume an interrupted generation on any engine."""

    prompt_tokens: list[int]  # the whole context, including what the interrupted turn already generated
    remaining_tokens: int  # the turn's token budget minus what it already generated


@dataclasses.dataclass(frozen=True)
class Batch:
    """What one training step consumes: whole groups of finished trajectories."""

    step: int
    policy_version: int
    groups: tuple[tuple[Trajectory, ...], ...]

    @property
    def trajectories(self) -> tuple[Trajectory, ...]:
        return tuple(t for group in self.groups for t in group)

    def __len__(self) -> int:
        return sum(len(group) for group in self.groups)

    @property
    def num_tokens(self) -> int:
        return sum(t.num_tokens for t in self.trajectories)

    @property
    def num_generated(self) -> int:
        return sum(t.num_generated for t in self.trajectories)


class _Live:
    """A trajectory the manager still holds (running, interrupted or finished): mutable, under the lock."""

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

    def tokens_newer_than(self, version: int) -> int:
        """How many of the current branch's generated tokens a policy newer than `version` produced."""
        return sum(int((self.segments[i].versions[:used] > version).sum()) for i, used in branch_of(self.segments)
                   if self.segments[i].generated and used)

    def snapshot(self) -> Trajectory:
        return Trajectory(id=self.id, segments=tuple(self.segments), task=self.task, group=self.group,
                          status=self.status, reward=self.reward, turn_rewards=self.turn_rewards,
                          metadata_json=self.metadata_json, created=self.created, updated=self.updated,
                          fail_reason=self.fail_reason)


def _fork_point(segments: Sequence[Segment], position: int) -> tuple[int, int]:
    """Where a segment continuing the current branch's first `position` tokens attaches: (parent, fork_at).

    At a boundary between two segments it attaches to the end of the earlier one.
    """
    start = 0
    for index, used in branch_of(segments):
        if position <= start + used:
            return index, position - start
        start += used
    raise ValueError(f"position {position} is past the end of the branch ({start} tokens)")


def _fits(value: str, limit: int, what: str) -> None:
    if len(value.encode("utf-8")) > limit:
        raise InvalidRequest(f"{what} is longer than {limit} bytes: {value[:40]!r}...")


def check_start(trajectory_id: str, task: str, group: str | None, metadata: dict | None) -> str:
    """Everything `TrajectoryManager.start` refuses but an id clash, checked where the call is made (a
    remote client sends `start` one-way after this); returns the metadata as stored (JSON)."""
    if not trajectory_id:
        raise InvalidRequest("a trajectory id cannot be empty")
    _fits(trajectory_id, layout.ID_BYTES, "trajectory id")
    _fits(task, layout.TASK_BYTES, "task name")
    if group is not None:
        _fits(group, layout.GROUP_BYTES, "group id")
    try:
        return Trajectory.encode_metadata(metadata)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


FIRST_REASONS = 3  # failure reasons a manager keeps in memory: enough to say why a run stopped
_CLOSED = (Status.CONSUMED, Status.STALE, Status.ABORTED, Status.FAILED)  # only their status is kept in memory


def new_trajectory_id() -> str:
    """A random 128-bit id: no two callers anywhere in a run draw the same one."""
    return uuid.uuid4().hex


class TrajectoryManager:
    """Thread-safe registry of trajectories; see the module docstring for the life of one."""

    def __init__(self, store: TrajectoryStore | None = None, *, max_staleness: int = 1,
                 flush_every: int = 64) -> None:
        if max_staleness < 0:
            raise InvalidRequest(f"max_staleness must be 0 or more, found {max_staleness}")
        if flush_every < 1:
            raise InvalidRequest(f"flush_every must be at least 1, found {flush_every}")
        self.store, self.max_staleness, self.flush_every = store, max_staleness, flush_every
        self._lock = threading.RLock()
        self._timeline_drain: Callable[[], Sequence[RankInterval]] | None = None  # see follow_timeline
        self._live: dict[str, _Live] = {}
        self._closed: dict[str, Status] = {}  # consumed, stale, aborted: only the status is kept in memory
        self._groups: dict[str, list[str]] = {}  # group key -> live member ids, oldest group first
        # Groups a failed member spoiled, still holding (or expecting) members: key -> how many of the group's
        # episodes have ended (finish or fail). Once all have, members left open are orphans (a first turn
        # whose agent failed before it learnt the id) and are aborted.
        self._spoiled: dict[str, int] = {}
        self._in_flight: set[str] = set()  # the book: groups handed out, not yet trained on or dropped
        self._keys: set[str] = set()  # every group key the run used (store included): never booked again
        self._fail_reasons: list[str] = []  # the first FIRST_REASONS distinct ones, for the message that stops a run
        self._next_step = 0
        self._finished_since_flush = 0
        if store is not None:
            self._resume_from(store)

    def _resume_from(self, store: TrajectoryStore) -> None:
        """Continue a run: reload what the store holds; generations that were running are interrupted."""
        view = store.view()
        statuses = view.statuses()
        spoiled: set[str] = set()
        for trajectory_id, status in statuses.items():
            if status is Status.FAILED:
                failed = view.get(trajectory_id)
                spoiled.add(failed.group_key)
                self._note_failure(failed.fail_reason)
            if status in _CLOSED:
                self._closed[trajectory_id] = status
                continue
            live = _Live(view.get(trajectory_id))
            if live.status is Status.RUNNING:  # the engine generating it died with the old process
                live.status, live.updated = Status.INTERRUPTED, time.time()
                store.set_status(live.id, live.status, when=live.updated)
            self._live[trajectory_id] = live
            self._groups.setdefault(live.group_key, []).append(trajectory_id)
        for key in spoiled & set(self._groups):  # never trained on; the episodes died with the old process
            for member in list(self._groups[key]):
                self._give_up(self._live[member])
        marks = view.marks()
        self._next_step = max((m.step for m in marks), default=-1) + 1
        # The keys of every group the store holds, closed ones included: a crash may have lost the controller's
        # record of them, never the store's.
        self._keys.update(filter(None, (layout.decode_text(g) for g in view.table("trajectories")["group"])))
        store.flush()

    # -- lookups ---------------------------------------------------------------------------------------

    def _get(self, trajectory_id: str) -> _Live:
        live = self._live.get(trajectory_id)
        if live is None:
            if trajectory_id in self._closed:
                raise TrajectoryFinished(f"trajectory {trajectory_id!r} is {self._closed[trajectory_id]}")
            raise UnknownTrajectory(f"no trajectory with id {trajectory_id!r}")
        return live

    def _open(self, trajectory_id: str) -> _Live:
        live = self._get(trajectory_id)
        if not live.status.is_open:
            raise TrajectoryFinished(f"trajectory {trajectory_id!r} is {live.status}; it takes no more tokens")
        return live

    def exists(self, trajectory_id: str) -> bool:
        with self._lock:
            return trajectory_id in self._live or trajectory_id in self._closed

    def status(self, trajectory_id: str) -> str:
        with self._lock:
            if trajectory_id in self._closed:
                return self._closed[trajectory_id]
            live = self._live.get(trajectory_id)
            if live is None:
                raise UnknownTrajectory(f"no trajectory with id {trajectory_id!r}")
            return live.status

    def trajectory(self, trajectory_id: str) -> Trajectory:
        """The record of a trajectory the manager holds (running, interrupted or finished)."""
        with self._lock:
            return self._get(trajectory_id).snapshot()

    def context(self, trajectory_id: str) -> list[int]:
        with self._lock:
            return self._get(trajectory_id).context().tolist()

    def ids(self, status: Status | str | None = None) -> list[str]:
        """Ids of the trajectories held in memory, optionally only those with `status`."""
        with self._lock:
            return [t for t, live in self._live.items() if status is None or live.status == status]

    def counts(self) -> dict[str, int]:
        """How many trajectories are in each status (the closed ones included)."""
        with self._lock:
            counts = dict.fromkeys((s.value for s in Status), 0)
            for live in self._live.values():
                counts[live.status] += 1
            for status in self._closed.values():
                counts[status] += 1
            return counts

    # -- recording -------------------------------------------------------------------------------------

    def start(self, prompt_tokens: Sequence[int], *, task: str = "", group: str | None = None,
              metadata: dict | None = None, trajectory_id: str | None = None) -> str:
        """Begin a trajectory with its prompt; returns its id (a new random one unless given)."""
        trajectory_id = new_trajectory_id() if trajectory_id is None else str(trajectory_id)
        metadata_json = check_start(trajectory_id, task, group, metadata)
        now = time.time()
        prompt = Segment(SegmentKind.PROMPT, -1, 0, np.asarray(prompt_tokens, np.int32), t_start=now, t_end=now)
        record = Trajectory(id=trajectory_id, segments=(prompt,), task=task, group=group, status=Status.RUNNING,
                            metadata_json=metadata_json, created=now, updated=now)
        with self._lock:
            if trajectory_id in self._live or trajectory_id in self._closed:
                raise TrajectoryExists(f"trajectory id {trajectory_id!r} is already in use")
            live = _Live(record)
            self._live[trajectory_id] = live
            self._groups.setdefault(live.group_key, []).append(trajectory_id)
            if group is not None:
                self._keys.add(group)
            if self.store is not None:
                self.store.add_trajectory(trajectory_id, task=task, group=group, metadata_json=metadata_json,
                                          created=now)
                self.store.add_segment(trajectory_id, prompt)
        return trajectory_id

    def _add(self, live: _Live, segment: Segment) -> None:
        live.append(segment)
        live.last_event = segment.t_end
        if self.store is not None:
            self.store.add_segment(live.id, segment)

    def _set_status(self, live: _Live, status: Status) -> None:
        live.status, live.updated = status, time.time()
        if self.store is not None and status is Status.FAILED:
            self.store.set_status(live.id, status, when=live.updated, reason=live.fail_reason)
        elif self.store is not None:  # every record carries the rewards: a reader needs only the latest one
            self.store.set_status(live.id, status, when=live.updated, reward=live.reward,
                                  turn_rewards=live.turn_rewards)

    def _given_up(self, trajectory_id: str) -> bool:
        """Whether the run gave this trajectory up (aborted, failed, or dropped as stale while it still
        played: `drop_hopeless`): late recording calls are dropped."""
        return self._closed.get(trajectory_id) in (Status.ABORTED, Status.FAILED, Status.STALE)

    def observe(self, trajectory_id: str, prompt_tokens: Sequence[int]) -> None:
        """Record a new turn's full prompt: what extends the current branch becomes an observation segment;
        a prompt that diverges from the branch forks a new branch where they part (both are kept)."""
        prompt = np.asarray(prompt_tokens, np.int32)
        with self._lock:
            live = self._open(trajectory_id)
            context = live.context()
            n = min(len(prompt), len(context))
            differ = np.flatnonzero(prompt[:n] != context[:n])
            common = int(differ[0]) if len(differ) else n
            if common == len(context) == len(prompt):
                return  # nothing new
            parent, fork_at = _fork_point(live.segments, common)
            now = time.time()
            self._add(live, Segment(SegmentKind.OBSERVATION, parent, fork_at, prompt[common:], t_start=now, t_end=now))
            if live.status is not Status.RUNNING:
                self._set_status(live, Status.RUNNING)

    def add_generated(self, trajectory_id: str, tokens: Sequence[int], logprobs: Sequence[float],
                      versions: int | Sequence[int], *, engine: str = "", finish_reason: str | None = None,
                      started_at: float | None = None, temperature: float | None = None,
                      top_p: float | None = None) -> None:
        """Append tokens the policy generated, with their sampling logprobs and policy version(s).

        `versions` is one version for every token, or one per token (a generation that spans a weight
        update). `started_at` defaults to the trajectory's previous event. `temperature` and `top_p` are
        the sampling the tokens were drawn with (None: unknown), kept on the segment for the trainer.
        """
        toks = np.asarray(tokens, np.int32)
        lps = np.asarray(logprobs, np.float32)
        vers = np.full(len(toks), versions, np.int32) if isinstance(versions, int | np.integer) \
            else np.asarray(versions, np.int32)
        if len(lps) != len(toks) or len(vers) != len(toks):
            raise InvalidRequest(f"{len(toks)} generated tokens need as many logprobs and versions; "
                                 f"got {len(lps)} logprobs and {len(vers)} versions")
        if len(toks) and vers.min() < 0:
            raise InvalidRequest("policy versions of generated tokens must be 0 or more")
        _fits(engine, layout.ENGINE_BYTES, "engine name")
        _fits(finish_reason or "", layout.REASON_BYTES, "finish reason")
        with self._lock:
            if self._given_up(trajectory_id):
                return
            live = self._open(trajectory_id)
            if not len(toks) and not finish_reason:
                return
            now = time.time()
            head = len(live.segments) - 1
            self._add(live, Segment(SegmentKind.GENERATED, head, len(live.segments[head]), toks, lps, vers,
                                    engine, live.last_event if started_at is None else started_at, now,
                                    finish_reason or "", temperature, top_p))
            if live.status is Status.INTERRUPTED:
                self._set_status(live, Status.RUNNING)

    def interrupt(self, trajectory_id: str) -> None:
        """Generation stopped mid-way; the recorded prefix is kept for a `continuation`."""
        with self._lock:
            if self._given_up(trajectory_id):
                return
            live = self._open(trajectory_id)
            if live.status is not Status.INTERRUPTED:
                self._set_status(live, Status.INTERRUPTED)

    def interrupt_all(self) -> list[str]:
        """Interrupt every running trajectory (a preemption's safe point); returns their ids."""
        with self._lock:
            running = [live for live in self._live.values() if live.status is Status.RUNNING]
            for live in running:
                self._set_status(live, Status.INTERRUPTED)
            return [live.id for live in running]

    def continuation(self, trajectory_id: str, max_new_tokens: int) -> Continuation:
        with self._lock:
            live = self._open(trajectory_id)
            live.last_event = time.time()  # the next generated segment starts now
            return Continuation(prompt_tokens=live.context().tolist(),
                                remaining_tokens=max(0, max_new_tokens - live.generated_this_turn()))

    def finish(self, trajectory_id: str, reward: float | None = None, *,
               turn_rewards: Sequence[float] | None = None) -> None:
        with self._lock:
            if self._given_up(trajectory_id):
                return
            live = self._open(trajectory_id)
            live.reward = None if reward is None else float(reward)
            live.turn_rewards = tuple(float(r) for r in turn_rewards or ())
            if live.group_key in self._spoiled:  # another member failed: kept with its reward, never trained on
                self._spoiled[live.group_key] += 1
                self._give_up(live)
                return
            self._set_status(live, Status.FINISHED)
            self._finished_since_flush += 1
            if self._finished_since_flush >= self.flush_every:
                self.flush()

    def fail(self, trajectory_id: str, reason: str) -> None:
        """The episode's agent or task raised or ran out of time: record why, never train on it, and drop
        its GRPO group (see the module docstring). A trajectory the run already gave up stays as it is."""
        with self._lock:
            if self._given_up(trajectory_id):
                return
            live = self._open(trajectory_id)  # an episode that ended (finish) can no longer fail
            key = live.group_key
            if key not in self._spoiled:
                ended = [self._live[m] for m in self._groups[key] if self._live[m].status is Status.FINISHED]
                self._spoiled[key] = len(ended)
                self._in_flight.discard(key)  # never trained on: the controller hands out another
                for member in ended:
                    self._give_up(member)
            self._spoiled[key] += 1
            live.fail_reason = reason
            self._note_failure(reason)
            self._set_status(live, Status.FAILED)
            self._drop(live)
            self.flush()  # a failure is rare and worth seeing at once (`sfhpc traj summary` while it runs)

    def _note_failure(self, reason: str) -> None:
        if len(self._fail_reasons) < FIRST_REASONS and reason not in self._fail_reasons:
            self._fail_reasons.append(reason)  # distinct: every member of a group often fails alike

    def _give_up(self, live: _Live) -> None:
        self._set_status(live, Status.ABORTED)
        self._drop(live)

    def fail_reasons(self) -> list[str]:
        """The first distinct reasons of the run's failures (at most FIRST_REASONS), oldest first."""
        with self._lock:
            return list(self._fail_reasons)

    def abort(self, trajectory_id: str) -> None:
        """Give a trajectory up: it is kept in the store as aborted and never trained on."""
        with self._lock:
            live = self._get(trajectory_id)
            if live.status is Status.FINISHED or live.status.is_open:
                self._set_status(live, Status.ABORTED)
                self._drop(live)

    def _drop(self, live: _Live) -> None:
        del self._live[live.id]
        self._closed[live.id] = live.status
        members = self._groups[live.group_key]
        members.remove(live.id)
        if not members:
            del self._groups[live.group_key]

    # -- batching --------------------------------------------------------------------------------------

    def _ready_groups(self, policy_version: int, group_size: int | None) -> Iterator[list[_Live]]:
        """Complete groups, oldest first; a group with a too-stale trajectory is marked stale and skipped.

        A group is complete when none of its members is still running or interrupted and its finished
        members come from at least `group_size` episodes (any number when None): an episode of several
        agents leaves one trajectory per agent (`episode_of`). GRPO normalises advantages within a group,
        so a group is used or dropped whole: training on its fresh members alone would bias the baseline.
        A group a failed member spoiled is never complete; once every one of its `group_size` episodes has
        ended, members still open are orphans (no agent holds them any more) and are aborted.
        """
        for key, ended in list(self._spoiled.items()):
            if group_size is not None and ended >= group_size:
                for member in list(self._groups.get(key, ())):
                    self._give_up(self._live[member])
                del self._spoiled[key]
        for key in list(self._groups):
            if key in self._spoiled:
                continue
            lives = [self._live[m] for m in self._groups[key]]
            if any(live.status.is_open for live in lives):
                continue
            finished = [live for live in lives if live.status is Status.FINISHED]
            episodes = {episode_of(live.id, live.metadata_json) for live in finished}
            if not finished or (group_size is not None and len(episodes) < group_size):
                continue
            if not self._fresh(finished, policy_version):
                for live in finished:
                    self._set_status(live, Status.STALE)
                    self._drop(live)
                self._in_flight.discard(key)
                continue
            yield finished

    def _fresh(self, lives: Sequence[_Live], policy_version: int) -> bool:
        """Whether a group may train `policy_version`: no token more than ``max_staleness`` versions older,
        and none newer (such a token came from weights a restart lost: its staleness would be negative)."""
        oldest = [v for v in (live.oldest_version() for live in lives) if v is not None]
        newest = [v for v in (live.newest_version() for live in lives) if v is not None]
        return not oldest or (policy_version - min(oldest) <= self.max_staleness and max(newest) <= policy_version)

    def drop_hopeless(self, policy_version: int) -> list[str]:
        """Drop, as stale, every group that can no longer be trained on: one of its members (finished or
        still playing) holds a token more than ``max_staleness`` versions older than `policy_version`.
        Versions only grow, so such a group would be dropped when complete anyway; dropped now, its members
        stop taking engine time from fresh groups (late records of theirs are ignored: `_given_up`).
        Returns the groups' keys, for the controller to cancel their episodes; they leave the book of
        groups in flight (the controller hands out others)."""
        hopeless = []
        with self._lock:
            for key in list(self._groups):
                if key in self._spoiled:
                    continue
                lives = [self._live[m] for m in self._groups[key]]
                oldest = [v for v in (live.oldest_version() for live in lives) if v is not None]
                if oldest and policy_version - min(oldest) > self.max_staleness:
                    for live in lives:
                        self._set_status(live, Status.STALE)
                        self._drop(live)
                    self._in_flight.discard(key)
                    hopeless.append(key)
        return hopeless

    def take_batch(self, policy_version: int, num_groups: int, group_size: int | None = None,
                   step: int | None = None) -> Batch | None:
        """The oldest `num_groups` complete, fresh groups for one training step, or None if not enough are
        ready (then nothing is consumed). The step's consumption is recorded and flushed to the store."""
        if num_groups < 1:
            raise InvalidRequest(f"num_groups must be at least 1, found {num_groups}")
        with self._lock:
            groups: list[list[_Live]] = []
            for members in self._ready_groups(policy_version, group_size):  # all of them: marks every stale group
                if len(groups) < num_groups:
                    groups.append(members)
            if len(groups) < num_groups:
                return None  # stale marks reach the file with the next flush; redoing them is harmless
            step = self._next_step if step is None else step
            records = []
            for members in groups:
                for live in members:
                    self._set_status(live, Status.CONSUMED)
                    self._drop(live)
                self._in_flight.discard(members[0].group_key)
                records.append(tuple(live.snapshot() for live in members))
            if self.store is not None:
                self.store.mark_consumed(step, [live.id for members in groups for live in members],
                                         policy_version=policy_version, when=groups[0][0].updated)
                self.flush()
            self._next_step = max(self._next_step, step + 1)
            return Batch(step=step, policy_version=policy_version, groups=tuple(records))

    # -- the book of groups in flight ----------------------------------------------------------------------

    def book_group(self, group: str, *, again: bool = False) -> None:
        """A GRPO group was handed out: it counts among `groups_in_flight` until it is trained on, dropped as
        stale or spoiled. A key the run already used is refused (InvalidRequest), so that a group never holds
        members of two hand-outs; `again` books a group of an earlier allocation that a restart continues."""
        _fits(group, layout.GROUP_BYTES, "group id")
        with self._lock:
            if group in self._keys and not again:
                raise InvalidRequest(f"group {group!r} was handed out before in this run; a group key is used once")
            self._keys.add(group)
            self._in_flight.add(group)

    def groups_in_flight(self) -> int:
        """How many booked groups are neither trained on nor dropped yet."""
        with self._lock:
            return len(self._in_flight)

    def in_flight(self, group: str) -> bool:
        """Whether `group` is booked and neither trained on nor dropped yet."""
        with self._lock:
            return group in self._in_flight

    # -- groups across a restart -------------------------------------------------------------------------

    def group_members(self, group: str) -> list[tuple[str, Status, int | None]]:
        """(id, status, oldest policy version) of a group's members still held, oldest first."""
        with self._lock:
            lives = sorted((self._live[m] for m in self._groups.get(group, ())), key=lambda live: live.created)
            return [(live.id, live.status, live.oldest_version()) for live in lives]

    def live_groups(self) -> list[str]:
        """Keys of the groups with members still held (running, interrupted or finished), oldest first."""
        with self._lock:
            return list(self._groups)

    def drop_group(self, group: str, status: Status) -> int:
        """Close every member of `group` still held with `status` (STALE or ABORTED); returns how many."""
        if status not in (Status.STALE, Status.ABORTED):
            raise InvalidRequest(f"a group is dropped as stale or aborted, not {status}")
        with self._lock:
            lives = [self._live[m] for m in self._groups.get(group, ())]
            for live in lives:
                self._set_status(live, status)
                self._drop(live)
            self._in_flight.discard(group)
            return len(lives)

    def drop_newer(self, policy_version: int) -> tuple[int, int]:
        """Abort every trajectory held that has tokens of a policy newer than `policy_version`: after a
        restart from a checkpoint of that version, those weights are lost, and such tokens can be neither
        trained on (their staleness would be negative) nor continued by the restored policy. Returns (the
        trajectories aborted, their tokens newer than the version)."""
        with self._lock:
            newer = [(live, live.tokens_newer_than(policy_version)) for live in self._live.values()]
            newer = [(live, count) for live, count in newer if count]
            for live, _ in newer:
                self._give_up(live)
            return len(newer), sum(count for _, count in newer)

    # -- durability ------------------------------------------------------------------------------------

    def follow_timeline(self, drain: Callable[[], Sequence[RankInterval]]) -> None:
        """Every flush (and the close) also writes the rank intervals `drain` returns: the controller's
        timeline reaches the store with the trajectories, never later than the next flush."""
        self._timeline_drain = drain

    def flush(self) -> None:
        """Write every buffered record to the store (no-op without a store)."""
        with self._lock:
            self._finished_since_flush = 0
            if self.store is not None:
                self._take_timeline()
                self.store.flush()

    def close(self) -> None:
        """Flush and close the store (trajectories still open stay resumable from it)."""
        with self._lock:
            if self.store is not None:
                self._take_timeline()
                self.store.close()

    def _take_timeline(self) -> None:
        if self._timeline_drain is not None and self.store is not None and not self.store.closed:
            self.store.add_intervals(self._timeline_drain())
