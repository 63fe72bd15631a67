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

Two owners sit behind it, under one lock: the `sfhpc.data.registry.TrajectoryRegistry` holds the
trajectories (what each one holds, its status, the store's records), the `sfhpc.data.groups.GroupBook` the
GRPO groups (members, the book of groups in flight, the keys used, and `take_batch`, which hands the
trainer whole fresh groups). Every record also goes to the `TrajectoryStore` (if one is given), which is
flushed every `flush_every` finished trajectories, at every batch, at every failure, and on `flush()`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from sfhpc.data import layout
from sfhpc.data.errors import InvalidRequest
from sfhpc.data.groups import Batch, GroupBook, is_evaluation
from sfhpc.data.rank_intervals import RankInterval
from sfhpc.data.registry import (  # noqa: F401  (check_start and new_trajectory_id: the manager's API too)
    TrajectoryRegistry,
    check_start,
    fits,
    fork_point,
    new_trajectory_id,
)
from sfhpc.data.store import TrajectoryStore
from sfhpc.data.trajectory import Segment, SegmentKind, Status, Trajectory

__all__ = ["Batch", "Continuation", "FIRST_REASONS", "TrajectoryManager", "check_start", "new_trajectory_id"]

FIRST_REASONS = 3  # failure reasons a manager keeps in memory: enough to say why a run stopped


@dataclasses.dataclass(frozen=True)
class Continuation:
    """How to resume an interrupted generation on any engine."""

    prompt_tokens: list[int]  # the whole context, including what the interrupted turn already generated
    remaining_tokens: int  # the turn's token budget minus what it already generated


class TrajectoryManager:
    """Thread-safe registry of trajectories and book of groups; see the module docstring for the life of one."""

    def __init__(self, store: TrajectoryStore | None = None, *, max_token_lag: int | None = None,
                 flush_every: int = 64) -> None:
        if flush_every < 1:
            raise InvalidRequest(f"flush_every must be at least 1, found {flush_every}")
        self._records = TrajectoryRegistry(store)
        self._groups = GroupBook(self._records, max_token_lag=max_token_lag)
        self.store, self.max_token_lag, self.flush_every = store, max_token_lag, flush_every
        self._lock = threading.RLock()
        self._timeline_drain: Callable[[], Sequence[RankInterval]] | None = None  # see follow_timeline
        self._fail_reasons: list[str] = []  # the first FIRST_REASONS distinct ones, for the message that stops a run
        self._finished_since_flush = 0
        if store is not None:  # continue a run: what the store holds, generations that were running interrupted
            view = store.view()
            failed = self._records.restore(view)
            for trajectory in failed:
                self._note_failure(trajectory.fail_reason)
            self._groups.restore(view, failed)
            store.flush()

    # -- lookups ---------------------------------------------------------------------------------------

    def exists(self, trajectory_id: str) -> bool:
        with self._lock:
            return self._records.exists(trajectory_id)

    def status(self, trajectory_id: str) -> str:
        with self._lock:
            return self._records.status(trajectory_id)

    def trajectory(self, trajectory_id: str) -> Trajectory:
        """The record of a trajectory the manager holds (running, interrupted or finished)."""
        with self._lock:
            return self._records.get(trajectory_id).snapshot()

    def context(self, trajectory_id: str) -> list[int]:
        with self._lock:
            return self._records.get(trajectory_id).context().tolist()

    def ids(self, status: Status | str | None = None) -> list[str]:
        """Ids of the trajectories held in memory, optionally only those with `status`."""
        with self._lock:
            return [t for t, live in self._records.live.items() if status is None or live.status == status]

    def counts(self) -> dict[str, int]:
        """How many trajectories are in each status (the closed ones included)."""
        with self._lock:
            return self._records.counts()

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
            self._groups.join(self._records.start(record))
        return trajectory_id

    def observe(self, trajectory_id: str, prompt_tokens: Sequence[int]) -> None:
        """Record a new turn's full prompt: what extends the current branch becomes an observation segment;
        a prompt that diverges from the branch forks a new branch where they part (both are kept)."""
        prompt = np.asarray(prompt_tokens, np.int32)
        with self._lock:
            live = self._records.open(trajectory_id)
            context = live.context()
            n = min(len(prompt), len(context))
            differ = np.flatnonzero(prompt[:n] != context[:n])
            common = int(differ[0]) if len(differ) else n
            if common == len(context) == len(prompt):
                return  # nothing new
            parent, fork_at = fork_point(live.segments, common)
            now = time.time()
            self._records.add(live, Segment(SegmentKind.OBSERVATION, parent, fork_at, prompt[common:], t_start=now,
                                            t_end=now))
            if live.status is not Status.RUNNING:
                self._records.set_status(live, Status.RUNNING)

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
        fits(engine, layout.ENGINE_BYTES, "engine name")
        fits(finish_reason or "", layout.REASON_BYTES, "finish reason")
        with self._lock:
            if self._records.given_up(trajectory_id):
                return
            live = self._records.open(trajectory_id)
            if not len(toks) and not finish_reason:
                return
            now = time.time()
            head = len(live.segments) - 1
            self._records.add(live, Segment(SegmentKind.GENERATED, head, len(live.segments[head]), toks, lps, vers,
                                    engine, live.last_event if started_at is None else started_at, now,
                                    finish_reason or "", temperature, top_p))
            if live.status is Status.INTERRUPTED:
                self._records.set_status(live, Status.RUNNING)

    def interrupt(self, trajectory_id: str) -> None:
        """Generation stopped mid-way; the recorded prefix is kept for a `continuation`."""
        with self._lock:
            if self._records.given_up(trajectory_id):
                return
            live = self._records.open(trajectory_id)
            if live.status is not Status.INTERRUPTED:
                self._records.set_status(live, Status.INTERRUPTED)

    def interrupt_all(self) -> list[str]:
        """Interrupt every running trajectory (a preemption's safe point); returns their ids."""
        with self._lock:
            running = [live for live in self._records.live.values() if live.status is Status.RUNNING]
            for live in running:
                self._records.set_status(live, Status.INTERRUPTED)
            return [live.id for live in running]

    def continuation(self, trajectory_id: str, max_new_tokens: int) -> Continuation:
        with self._lock:
            live = self._records.open(trajectory_id)
            live.last_event = time.time()  # the next generated segment starts now
            return Continuation(prompt_tokens=live.context().tolist(),
                                remaining_tokens=max(0, max_new_tokens - live.generated_this_turn()))

    def finish(self, trajectory_id: str, reward: float | None = None, *,
               turn_rewards: Sequence[float] | None = None) -> None:
        with self._lock:
            if self._records.given_up(trajectory_id):
                return
            live = self._records.open(trajectory_id)
            live.reward = None if reward is None else float(reward)
            live.turn_rewards = tuple(float(r) for r in turn_rewards or ())
            if is_evaluation(live.group):
                self._groups.end_evaluation(live, failed=False)
                return
            if self._groups.spoiled(live):  # another member failed: kept with its reward, never trained on
                return
            self._records.set_status(live, Status.FINISHED)
            self._finished_since_flush += 1
            if self._finished_since_flush >= self.flush_every:
                self.flush()

    def fail(self, trajectory_id: str, reason: str) -> None:
        """The episode's agent or task raised or ran out of time: record why, never train on it, and drop
        its GRPO group (see the module docstring). A trajectory the run already gave up stays as it is."""
        with self._lock:
            if self._records.given_up(trajectory_id):
                return
            live = self._records.open(trajectory_id)  # an episode that ended (finish) can no longer fail
            live.fail_reason = reason
            self._note_failure(reason)
            if is_evaluation(live.group):
                self._groups.end_evaluation(live, failed=True)
            else:
                self._groups.spoil(live)
            self.flush()  # a failure is rare and worth seeing at once (`sfhpc traj summary` while it runs)

    def finish_episode(self, trajectory_id: str, reward: float | None = None, *,
                       turn_rewards: Sequence[float] | None = None,
                       others: Sequence[tuple[str, float | None]] = ()) -> None:
        """An episode ended with a reward: `finish` its trajectory and those of its other agents (`others`,
        each with its own reward). One call per episode, however many trajectories it left: what a rank's
        count of running episodes is kept by (`sfhpc.data.service.EPISODE_ENDS`)."""
        self.finish(trajectory_id, reward, turn_rewards=turn_rewards)
        for other, other_reward in others:
            self.finish(other, other_reward)

    def fail_episode(self, trajectory_ids: Sequence[str], reason: str) -> None:
        """An episode failed: `fail` every trajectory it started (one per agent, or per choice of a call that
        asked for several). One call per episode, as `finish_episode`."""
        for trajectory_id in trajectory_ids:
            self.fail(trajectory_id, reason)

    def _note_failure(self, reason: str) -> None:
        if len(self._fail_reasons) < FIRST_REASONS and reason not in self._fail_reasons:
            self._fail_reasons.append(reason)  # distinct: every member of a group often fails alike

    def fail_reasons(self) -> list[str]:
        """The first distinct reasons of the run's failures (at most FIRST_REASONS), oldest first."""
        with self._lock:
            return list(self._fail_reasons)

    def abort(self, trajectory_id: str) -> None:
        """Give a trajectory up: it is kept in the store as aborted and never trained on."""
        with self._lock:
            live = self._records.get(trajectory_id)
            if live.status is Status.FINISHED or live.status.is_open:
                self._groups.give_up(live)

    # -- batching and the book of groups (sfhpc.data.groups) ------------------------------------------------

    def drop_hopeless(self, policy_version: int) -> list[str]:
        """Drop, as stale, every group that can no longer be trained on (`GroupBook.drop_hopeless`); returns
        their keys, for the controller to cancel their episodes."""
        with self._lock:
            return self._groups.drop_hopeless(policy_version)

    def complete_groups(self, policy_version: int, group_size: int | None = None) -> int:
        """How many complete groups could train `policy_version` now (`GroupBook.complete`); nothing is taken."""
        with self._lock:
            return self._groups.complete(policy_version, group_size)

    def take_batch(self, policy_version: int, num_groups: int, group_size: int | None = None,
                   step: int | None = None) -> Batch | None:
        """The oldest `num_groups` complete, trainable groups for one training step, or None if not enough are
        ready (then nothing is consumed). The step's consumption is recorded and flushed to the store."""
        with self._lock:
            batch = self._groups.take_batch(policy_version, num_groups, group_size, step)
            if batch is not None:
                self.flush()
            return batch

    def record_scores(self, step: int, scorer: str, scores: Sequence[tuple[str, np.ndarray]]) -> None:
        """Per-token scores of trajectories trained at `step` (the distillation teacher's log-probabilities),
        into the store with its next flush (`TrajectoryStore.add_scores`; no-op without a store)."""
        with self._lock:
            if self.store is not None:
                self.store.add_scores(step, scorer, scores)

    def judge_groups(self, judge: Callable[[Sequence[Trajectory]], bool] | None) -> None:
        """Dynamic sampling: from now on a complete group whose trajectories `judge` finds without a training
        signal is closed ``filtered`` instead of trained on, and leaves the book (None: every group trains).
        Groups judged already stay as judged."""
        with self._lock:
            self._groups.judge = judge

    def filtered_groups(self) -> int:
        """Groups closed ``filtered`` by dynamic sampling since this manager started."""
        with self._lock:
            return self._groups.filtered

    def take_evaluation(self, groups: Sequence[str], episodes: int) -> dict[str, dict[str, float | None]] | None:
        """The episodes of evaluation `groups` and their rewards (None: failed) once `episodes` of each ended
        (`GroupBook.take_evaluation`), else None."""
        with self._lock:
            return self._groups.take_evaluation(groups, episodes)

    def book_group(self, group: str, *, again: bool = False) -> None:
        """A GRPO group was handed out (`GroupBook.book`): it counts among `groups_in_flight` until it is
        trained on, dropped as stale or spoiled; a key is booked once (`again`: a restart continues it)."""
        with self._lock:
            self._groups.book(group, again=again)

    def dropped_tokens(self) -> dict[str, int]:
        """Policy tokens never trained on since this manager started, by cause: ``stale``, ``aborted``,
        ``failed``, ``filtered`` (every token of such a trajectory), ``off-branch`` (tokens a fork left behind on a
        trained trajectory)."""
        with self._lock:
            return dict(self._groups.dropped_tokens)

    def groups_in_flight(self) -> int:
        """How many booked groups are neither trained on nor dropped yet."""
        with self._lock:
            return len(self._groups.in_flight())

    def overdue_groups(self, policy_version: int, lag: int, group_size: int | None = None) -> int:
        """Groups in flight that still play (some of their `group_size` episodes not ended) with their oldest
        token `lag` or more versions behind `policy_version` (`GroupBook.overdue`): the pipeline policy's
        admission leaves them out."""
        with self._lock:
            return self._groups.overdue(policy_version, lag, group_size)

    def in_flight(self, group: str) -> bool:
        """Whether `group` is booked and neither trained on nor dropped yet."""
        with self._lock:
            return group in self._groups.in_flight()

    def group_members(self, group: str) -> list[tuple[str, Status, int | None]]:
        """(id, status, oldest policy version) of a group's members still held, oldest first."""
        with self._lock:
            return self._groups.members(group)

    def group_episodes(self, group: str) -> list[list[tuple[str, Status, int | None]]]:
        """`group_members` of `group`, one list per episode (`GroupBook.episodes`), oldest first."""
        with self._lock:
            return self._groups.episodes(group)

    def live_groups(self) -> list[str]:
        """Keys of the groups with members still held (running, interrupted or finished), oldest first."""
        with self._lock:
            return self._groups.live_groups()

    def drop_group(self, group: str, status: Status) -> int:
        """Close every member of `group` still held with `status` (STALE or ABORTED); returns how many."""
        with self._lock:
            return self._groups.drop(group, status)

    def drop_newer(self, policy_version: int) -> tuple[int, int]:
        """Abort every trajectory held that has tokens of a policy newer than `policy_version`: after a
        restart from a checkpoint of that version, those weights are lost, and such tokens can be neither
        trained on (their staleness would be negative) nor continued by the restored policy. Returns (the
        trajectories aborted, their tokens newer than the version)."""
        with self._lock:
            return self._groups.drop_newer(policy_version)

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
