"""The GRPO groups of a run and the batches made of them.

A group is the trajectories that share a group key (an untitled trajectory is a group of its own). The
`GroupBook` knows each live group's members; which groups a failed member *spoiled* (never trained on: GRPO
needs whole groups); the *book* of groups handed out and not yet trained on or dropped, by which the
controller hands out work (`groups_in_flight`), so no count of its own can drift from what is held; and every
key the run ever used (in this process or in the store), never booked again, so the members of two
hand-outs can never meet in one group, also after a crash lost the controller's state.

`take_batch` hands the trainer whole groups that may train the policy, oldest first, and records in the
store which step consumed them, so nothing is trained on twice, also across a restart. A group may train a
policy version when none of its tokens is newer than it (a token newer than the policy came from weights a
restart lost) and, under a ``max_token_lag``, none lags it by more than that many versions (`trainable`;
the pipeline policy, `sfhpc.rl.pipeline_policy`, says why there is no age bound by default). With a `judge`
(dynamic sampling, `sfhpc.rl.dynamic_sampling`) a complete group is also judged once, when it is complete:
one without a signal is closed ``filtered`` and leaves the book, kept in the store, never trained on.

The book changes the trajectories' statuses through the `TrajectoryRegistry` it is given; neither is
thread-safe: the `sfhpc.data.manager.TrajectoryManager` holds the lock over both.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

from sfhpc.data import layout
from sfhpc.data.errors import InvalidRequest
from sfhpc.data.registry import LiveTrajectory, TrajectoryRegistry, fits
from sfhpc.data.store import StoreView
from sfhpc.data.trajectory import Status, Trajectory, episode_of


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


DROP_CAUSES = ("stale", "aborted", "failed", "filtered", "off-branch")  # why policy tokens were never trained on
# The group key of an evaluation episode (`sfhpc.rl.evaluation`) begins so: such a group is never booked, never
# in a batch; each of its trajectories is closed as it ends (evaluated, or failed) and its episode's reward noted.
EVALUATION_PREFIX = "eval-"


def is_evaluation(group: str | None) -> bool:
    """Whether `group` is an evaluation group's key."""
    return group is not None and group.startswith(EVALUATION_PREFIX)


def trainable(policy_version: int, oldest: int | None, newest: int | None, max_token_lag: int | None) -> bool:
    """Whether tokens sampled by versions `oldest`..`newest` (None: no token) may train `policy_version`: none
    newer than it, and none more than `max_token_lag` versions older (None: no bound)."""
    if oldest is None or newest is None:
        return True
    if newest > policy_version:
        return False
    return max_token_lag is None or policy_version - oldest <= max_token_lag


def hopeless(policy_version: int, oldest: int | None, max_token_lag: int | None) -> bool:
    """Whether a group whose oldest token is of version `oldest` can never train a policy from
    `policy_version` on (versions only grow): it lags more than `max_token_lag` already."""
    return max_token_lag is not None and oldest is not None and policy_version - oldest > max_token_lag


def overdue(policy_version: int, oldest: int | None, lag: int) -> bool:
    """Whether a group that still plays, its oldest token of version `oldest` (None: no token yet), is overdue
    at `policy_version`: that token lags `lag` or more versions (`PipelinePolicy.overdue_lag`). The one rule
    the run's trajectory manager and the simulator both count by."""
    return oldest is not None and policy_version - oldest >= lag


def _oldest(lives: Sequence[LiveTrajectory]) -> int | None:
    """The oldest policy version among the members' generated tokens (None: no token yet)."""
    return min((v for v in (live.oldest_version() for live in lives) if v is not None), default=None)


class GroupBook:
    """Groups, the book of those in flight, and batches (see the module); not thread-safe."""

    def __init__(self, registry: TrajectoryRegistry, *, max_token_lag: int | None = None) -> None:
        if max_token_lag is not None and max_token_lag < 0:
            raise InvalidRequest(f"max_token_lag must be 0 or more, found {max_token_lag}")
        self.registry, self.max_token_lag = registry, max_token_lag
        self._members: dict[str, list[str]] = {}  # group key -> live member ids, oldest group first
        # Groups a failed member spoiled, still holding (or expecting) members: key -> how many of the group's
        # episodes have ended (finish or fail). Once all have, members left open are orphans (a first turn
        # whose agent failed before it learnt the id) and are aborted.
        self._spoiled: dict[str, int] = {}
        self._in_flight: set[str] = set()  # the book: groups handed out, not yet trained on or dropped
        self._keys: set[str] = set()  # every group key the run used (store included): never booked again
        # Evaluation groups: key -> episode -> its reward (None: failed), as their episodes end (`end_evaluation`).
        self._evaluated: dict[str, dict[str, float | None]] = {}
        self._next_step = 0
        # Dynamic sampling: whether a complete group's trajectories carry a training signal (None: all do), the
        # groups judged to carry one, and how many were filtered (closed, never trained) this run.
        self.judge: Callable[[Sequence[Trajectory]], bool] | None = None
        self._judged: set[str] = set()
        self.filtered = 0
        # Policy tokens never trained on, by cause: a trajectory closed stale, aborted or failed (all its
        # tokens), or trained with tokens off its branch (a fork left them behind). Counted as they happen.
        self.dropped_tokens: Counter[str] = Counter()

    def restore(self, view: StoreView, failed: Sequence[Trajectory]) -> None:
        """After `TrajectoryRegistry.restore` of `view`: the groups of the live trajectories, the `failed`
        ones' given up for good (their episodes died with the old process), the next step and every key used."""
        for live in self.registry.live.values():
            self.join(live)
        for key in {t.group_key for t in failed} & set(self._members):
            for member in list(self._members[key]):
                self.give_up(self.registry.live[member])
        self._next_step = max((m.step for m in view.marks()), default=-1) + 1
        # The keys of every group the store holds, closed ones included: a crash may have lost the controller's
        # record of them, never the store's.
        self._keys.update(filter(None, (layout.decode_text(g) for g in view.table("trajectories")["group"])))

    # -- members ---------------------------------------------------------------------------------------

    def join(self, live: LiveTrajectory) -> None:
        self._members.setdefault(live.group_key, []).append(live.id)
        if live.group is not None:
            self._keys.add(live.group)

    def close(self, live: LiveTrajectory, status: Status | None = None) -> None:
        """`live` leaves the live set (with `status`, if given) and its group."""
        if status is not None:
            self.registry.set_status(live, status)
            every, on_branch = live.generated_tokens()
            if status is Status.CONSUMED:
                self.dropped_tokens["off-branch"] += every - on_branch
            else:
                self.dropped_tokens[status.value] += every
        self.registry.close(live)
        members = self._members[live.group_key]
        members.remove(live.id)
        if not members:
            del self._members[live.group_key]
            self._judged.discard(live.group_key)

    def give_up(self, live: LiveTrajectory) -> None:
        self.close(live, Status.ABORTED)

    def _lives(self, key: str) -> list[LiveTrajectory]:
        return [self.registry.live[m] for m in self._members.get(key, ())]

    # -- an episode's end ------------------------------------------------------------------------------------

    def spoiled(self, live: LiveTrajectory) -> bool:
        """A member finished: True when a failed member spoiled its group (it is then given up, kept with its
        reward, never trained on)."""
        if live.group_key not in self._spoiled:
            return False
        self._spoiled[live.group_key] += 1
        self.give_up(live)
        return True

    def spoil(self, live: LiveTrajectory) -> None:
        """A member failed: its group is never trained on and leaves the book (the controller hands out
        another); members that ended already are given up at once, the others as they end."""
        key = live.group_key
        if key not in self._spoiled:
            ended = [m for m in self._lives(key) if m.status is Status.FINISHED]
            self._spoiled[key] = len(ended)
            self._in_flight.discard(key)
            for member in ended:
                self.give_up(member)
        self._spoiled[key] += 1
        self.close(live, Status.FAILED)

    # -- evaluation episodes ---------------------------------------------------------------------------

    def end_evaluation(self, live: LiveTrajectory, *, failed: bool) -> None:
        """A trajectory of an evaluation group ended: it is closed at once (evaluated, or failed), its tokens
        counted nowhere (they were never meant for training), and its episode's reward noted; the first of an
        episode's trajectories to end speaks for it (`TrajectoryManager.finish_episode` ends the main one
        first)."""
        ended = self._evaluated.setdefault(live.group_key, {})
        ended.setdefault(episode_of(live.id, live.metadata_json), None if failed else live.reward)
        self.registry.set_status(live, Status.FAILED if failed else Status.EVALUATED)
        self.close(live)

    def take_evaluation(self, groups: Sequence[str], episodes: int) -> dict[str, dict[str, float | None]] | None:
        """Once `episodes` episodes of every evaluation group in `groups` have ended: each group's episodes
        and their rewards (None: failed), forgotten here; else None."""
        if any(len(self._evaluated.get(g, ())) < episodes for g in groups):
            return None
        return {g: self._evaluated.pop(g) for g in groups}

    # -- batching --------------------------------------------------------------------------------------

    def _ready_groups(self, policy_version: int, group_size: int | None) -> Iterator[list[LiveTrajectory]]:
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
                for member in self._lives(key):
                    self.give_up(member)
                del self._spoiled[key]
        for key in list(self._members):
            if key in self._spoiled or is_evaluation(key):
                continue
            lives = self._lives(key)
            if any(live.status.is_open for live in lives):
                continue
            finished = [live for live in lives if live.status is Status.FINISHED]
            episodes = {episode_of(live.id, live.metadata_json) for live in finished}
            if not finished or (group_size is not None and len(episodes) < group_size):
                continue
            if not self._trainable(finished, policy_version):
                for live in finished:
                    self.close(live, Status.STALE)
                self._in_flight.discard(key)
                continue
            if self.judge is not None and key not in self._judged:
                if not self.judge([live.snapshot() for live in finished]):
                    for live in finished:
                        self.close(live, Status.FILTERED)
                    self._in_flight.discard(key)
                    self.filtered += 1
                    continue
                self._judged.add(key)  # judged once: a group waiting for its batch is not snapshotted again
            yield finished

    def _trainable(self, lives: Sequence[LiveTrajectory], policy_version: int) -> bool:
        newest = [v for v in (live.newest_version() for live in lives) if v is not None]
        return trainable(policy_version, _oldest(lives), max(newest, default=None), self.max_token_lag)

    def overdue(self, policy_version: int, lag: int, group_size: int | None = None) -> int:
        """How many groups in flight still play with their oldest token `lag` or more versions older than
        `policy_version` (`overdue`). A group still plays while a member runs or is interrupted, or while
        fewer than `group_size` of its episodes have a finished member (one not begun yet plays too)."""
        count = 0
        for key in self._in_flight:
            lives = self._lives(key)
            finished = {episode_of(live.id, live.metadata_json) for live in lives if live.status is Status.FINISHED}
            playing = (any(live.status.is_open for live in lives)
                       or (group_size is not None and len(finished) < group_size))
            count += playing and overdue(policy_version, _oldest(lives), lag)
        return count

    def drop_hopeless(self, policy_version: int) -> list[str]:
        """Drop, as stale, every group that can no longer be trained on: one of its members (finished or
        still playing) holds a token more than ``max_token_lag`` versions older than `policy_version` (none
        without that bound).
        Versions only grow, so such a group would be dropped when complete anyway; dropped now, its members
        stop taking engine time from fresh groups (late records of theirs are ignored). Returns the groups'
        keys, for the controller to cancel their episodes; they leave the book (the controller hands out
        others)."""
        dropped = []
        for key in list(self._members):
            if key in self._spoiled or is_evaluation(key):
                continue
            lives = self._lives(key)
            if hopeless(policy_version, _oldest(lives), self.max_token_lag):
                for live in lives:
                    self.close(live, Status.STALE)
                self._in_flight.discard(key)
                dropped.append(key)
        return dropped

    def complete(self, policy_version: int, group_size: int | None = None) -> int:
        """How many complete groups may train `policy_version` now (groups found too stale are dropped)."""
        return sum(1 for _ in self._ready_groups(policy_version, group_size))

    def take_batch(self, policy_version: int, num_groups: int, group_size: int | None = None,
                   step: int | None = None) -> Batch | None:
        """The oldest `num_groups` complete, fresh groups for one training step, or None if not enough are
        ready (then nothing is consumed). The step's consumption is recorded in the store (unflushed)."""
        if num_groups < 1:
            raise InvalidRequest(f"num_groups must be at least 1, found {num_groups}")
        groups: list[list[LiveTrajectory]] = []
        for members in self._ready_groups(policy_version, group_size):  # all of them: marks every stale group
            if len(groups) < num_groups:
                groups.append(members)
        if len(groups) < num_groups:
            return None  # stale marks reach the file with the next flush; redoing them is harmless
        step = self._next_step if step is None else step
        records = []
        for members in groups:
            for live in members:
                self.close(live, Status.CONSUMED)
            self._in_flight.discard(members[0].group_key)
            records.append(tuple(live.snapshot() for live in members))
        if self.registry.store is not None:
            self.registry.store.mark_consumed(step, [live.id for members in groups for live in members],
                                              policy_version=policy_version, when=groups[0][0].updated)
        self._next_step = max(self._next_step, step + 1)
        return Batch(step=step, policy_version=policy_version, groups=tuple(records))

    # -- the book of groups in flight ----------------------------------------------------------------------

    def book(self, group: str, *, again: bool = False) -> None:
        """A group was handed out: it counts among `in_flight` until it is trained on, dropped as stale or
        spoiled. A key the run already used is refused (InvalidRequest), so that a group never holds members
        of two hand-outs; `again` books a group of an earlier allocation that a restart continues."""
        fits(group, layout.GROUP_BYTES, "group id")
        if group in self._keys and not again:
            raise InvalidRequest(f"group {group!r} was handed out before in this run; a group key is used once")
        self._keys.add(group)
        self._in_flight.add(group)

    def in_flight(self) -> set[str]:
        """The booked groups neither trained on nor dropped yet."""
        return self._in_flight

    # -- groups across a restart -------------------------------------------------------------------------

    def members(self, group: str) -> list[tuple[str, Status, int | None]]:
        """(id, status, oldest policy version) of a group's members still held, oldest first."""
        lives = sorted(self._lives(group), key=lambda live: live.created)
        return [(live.id, live.status, live.oldest_version()) for live in lives]

    def episodes(self, group: str) -> list[list[tuple[str, Status, int | None]]]:
        """A group's members still held (as `members`), one list per episode (an episode of several agents
        holds a trajectory per agent: `episode_of`), the oldest episode first."""
        lives = sorted(self._lives(group), key=lambda live: live.created)
        by_episode: dict[str, list[tuple[str, Status, int | None]]] = {}
        for live in lives:
            by_episode.setdefault(episode_of(live.id, live.metadata_json), []).append(
                (live.id, live.status, live.oldest_version()))
        return list(by_episode.values())

    def live_groups(self) -> list[str]:
        """Keys of the groups with members still held (running, interrupted or finished), oldest first."""
        return list(self._members)

    def drop(self, group: str, status: Status) -> int:
        """Close every member of `group` still held with `status` (STALE or ABORTED); returns how many."""
        if status not in (Status.STALE, Status.ABORTED):
            raise InvalidRequest(f"a group is dropped as stale or aborted, not {status}")
        lives = self._lives(group)
        for live in lives:
            self.close(live, status)
        self._in_flight.discard(group)
        self._evaluated.pop(group, None)  # an evaluation cut short: its ended episodes are not asked for
        return len(lives)

    def drop_newer(self, policy_version: int) -> tuple[int, int]:
        """Abort every trajectory held that has tokens of a policy newer than `policy_version` (see
        `TrajectoryManager.drop_newer`), and with it the rest of its episode: an episode of several agents is
        trained whole or not at all, so its finished members must not wait for a batch without it. Returns
        (the trajectories aborted, their tokens newer than the version)."""
        newer = [(live, live.tokens_newer_than(policy_version)) for live in self.registry.live.values()]
        newer = [(live, count) for live, count in newer if count]
        episodes = {(live.group_key, episode_of(live.id, live.metadata_json)) for live, _ in newer}
        doomed = [live for live in self.registry.live.values()
                  if (live.group_key, episode_of(live.id, live.metadata_json)) in episodes]
        for live in doomed:
            self.give_up(live)
        return len(doomed), sum(count for _, count in newer)
