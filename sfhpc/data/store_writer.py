"""Writing a trajectory store: the run's single writer (the controller).

`TrajectoryStore` buffers records in memory and writes them at `flush()`, the data before the rows that
point into it and a commit row last (see `sfhpc.data.layout`). The file is in SWMR mode, so readers can
follow a run while it writes, and a writer killed at any moment leaves a file that reopens with every
flushed trajectory intact.

sfhpc never overwrites an existing file: `create` refuses a path that exists, `reopen` appends to it (in
the file's own schema: a store an older sfhpc created keeps its layout). One writer at a time is enforced
with a lock file beside the store (`sfhpc.data.store_lock`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import os
import re
import shutil
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from sfhpc.data import layout
from sfhpc.data.errors import InvalidRequest, StoreError, StoreExists, StoreFull, UnknownTrajectory
from sfhpc.data.h5native import CRASHED_WRITER_MESSAGE, open_clearing_crash_mark
from sfhpc.data.rank_intervals import RankInterval
from sfhpc.data.store_lock import release_writer_lock, take_writer_lock
from sfhpc.data.store_reader import StoreView, check_layout, describe_open_failure, open_readonly
from sfhpc.data.trajectory import Segment, Status, Trajectory

_NONE = float("nan")  # how "no reward" and "unknown sampling" are stored
_fixed = layout.encode_fixed
_text = layout.decode_text


@functools.lru_cache(maxsize=1024)
def _fixed_cached(value: str, size: int, what: str) -> bytes:
    """`_fixed` for the few values that repeat in every row (engine names, finish reasons, roles, states)."""
    return _fixed(value, size, what)


@dataclasses.dataclass
class StoreStats:
    """Where the writer's time went (the benchmark reports these)."""

    seconds_buffering: float = 0.0  # in add_* calls
    seconds_flushing: float = 0.0  # in flush(): writing and flushing HDF5
    flushes: int = 0
    tokens: int = 0
    trajectories: int = 0

    @property
    def seconds(self) -> float:
        return self.seconds_buffering + self.seconds_flushing


class TrajectoryStore:
    """The single writer of a run's store. Build with `create`, `reopen` or `open`.

    Records are buffered and reach the file at `flush()`; nothing is visible to readers (or survives a
    crash) before that. The caller flushes per batch; `close()` flushes too.
    """

    def __init__(self, path: Path, file: h5py.File, lock_fd: int) -> None:
        self.path, self._file, self._lock_fd = path, file, lock_fd
        self._layout = layout.schema(int(file.attrs[layout.SCHEMA_ATTR]))  # a reopened file keeps its schema
        self._ds = {name: file[name] for name in self._layout.datasets}
        commits = self._ds[layout.COMMITS]
        last = commits[commits.shape[0] - 1]
        self._committed = {name: int(last[name.replace("/", ".")]) for name in self._layout.growing}
        self._next = dict(self._committed)  # lengths including what is buffered
        self._pending: dict[str, list[Any]] = {name: [] for name in self._layout.growing}
        self._sampling = "temperature" in (self._layout.tables["segments"].names or ())
        self.session = int(last["session"])
        ids = self._ds["trajectories"][: self._committed["trajectories"]]["id"]
        self._rows = {_text(raw): row for row, raw in enumerate(ids)}
        seg_owner = self._ds["segments"][: self._committed["segments"]]["trajectory"]
        self._segments_of = Counter(np.asarray(seg_owner).tolist())
        self.stats = StoreStats()
        self._closed = False

    # -- opening -----------------------------------------------------------------------------------------

    @classmethod
    def create(cls, path: str | os.PathLike[str], *, run_metadata: dict[str, Any] | None = None) -> TrajectoryStore:
        """Create a new store; refuses (StoreExists) when anything is at `path`."""
        path = Path(path)
        if path.exists():
            raise StoreExists(f"{path}: already exists; sfhpc never overwrites a store: "
                              "pass a new path, or reopen this one to continue its run")
        if not path.parent.is_dir():
            raise StoreError(f"{path}: folder {path.parent} does not exist")
        try:
            run_json = Trajectory.encode_metadata(run_metadata)
        except ValueError as exc:
            raise InvalidRequest(f"{path}: run metadata: {exc}") from None
        lock_fd = take_writer_lock(path)
        try:
            try:
                file = h5py.File(path, "x", libver="latest", locking=False)  # "x": fails if the file appeared meanwhile
            except FileExistsError:
                raise StoreExists(f"{path}: already exists; sfhpc never overwrites a store") from None
            # SWMR cannot add objects or attributes: create every one of them before switching it on.
            file.attrs[layout.SCHEMA_ATTR] = layout.SCHEMA_VERSION
            file.attrs[layout.KIND_ATTR] = layout.KIND
            file.attrs[layout.CREATED_ATTR] = time.time()
            file.attrs[layout.RUN_ATTR] = run_json
            current = layout.schema(layout.SCHEMA_VERSION)
            for name, dtype in current.datasets.items():
                file.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(layout.chunk_of(name),))
            _start_session(file, dict.fromkeys(current.growing, 0), session=1)
        except BaseException:
            release_writer_lock(lock_fd)
            raise
        return cls(path, file, lock_fd)

    @classmethod
    def reopen(cls, path: str | os.PathLike[str]) -> TrajectoryStore:
        """Reopen an existing store to append to it (a restarted run), also after its writer was killed.

        Elements past the last commit (a flush the old writer did not finish) are dropped.
        """
        path = Path(path)
        with contextlib.closing(open_readonly(path)) as probe:  # validate before anything is written
            try:
                check_layout(path, probe)
                StoreView(path, probe, follow=True)
            except (OSError, KeyError, ValueError, RuntimeError) as exc:
                raise describe_open_failure(path, exc) from None
        lock_fd = take_writer_lock(path)
        try:
            try:
                file = h5py.File(path, "r+", libver="latest", locking=False)
            except OSError as exc:
                if CRASHED_WRITER_MESSAGE not in str(exc):
                    raise describe_open_failure(path, exc) from None
                # We hold the writer lock, so the writer that left the mark is gone: clear it, as h5clear would.
                try:
                    file = open_clearing_crash_mark(path)
                except OSError as exc2:
                    raise StoreError(f"{path}: its last writer was killed and the file cannot be reopened for "
                                     f"writing ({exc2}); run `h5clear -s {path}` and retry") from None
            commits = file[layout.COMMITS]
            last = commits[commits.shape[0] - 1]
            growing = layout.schema(int(file.attrs[layout.SCHEMA_ATTR])).growing
            counts = {name: int(last[name.replace("/", ".")]) for name in growing}
            for name, count in counts.items():
                if file[name].shape[0] != count:
                    file[name].resize((count,))  # the uncommitted tail of a flush that never finished
            _start_session(file, counts, session=int(last["session"]) + 1)
        except BaseException:
            release_writer_lock(lock_fd)
            raise
        return cls(path, file, lock_fd)

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, run_metadata: dict[str, Any] | None = None) -> TrajectoryStore:
        """`reopen` the store at `path` if there is one, else `create` it."""
        return cls.reopen(path) if Path(path).exists() else cls.create(path, run_metadata=run_metadata)

    # -- appending ---------------------------------------------------------------------------------------

    def __contains__(self, trajectory_id: str) -> bool:
        return trajectory_id in self._rows

    def _push(self, name: str, values: Any, count: int) -> int:
        start = self._next[name]
        self._pending[name].append(values)
        self._next[name] = start + count
        return start

    def _row(self, trajectory_id: str) -> int:
        row = self._rows.get(trajectory_id)
        if row is None:
            raise UnknownTrajectory(f"{self.path}: no trajectory with id {trajectory_id!r}")
        return row

    def add_trajectory(self, trajectory_id: str, *, task: str = "", group: str | None = None,
                       metadata_json: str = "{}", created: float | None = None) -> None:
        """Record a new trajectory's header (its segments and status follow)."""
        began = time.perf_counter()
        self._check_open()
        if trajectory_id in self._rows:
            raise InvalidRequest(f"{self.path}: trajectory id {trajectory_id!r} is already in the store")
        row_values = (_fixed(trajectory_id, layout.ID_BYTES, "trajectory id"),
                      _fixed(task, layout.TASK_BYTES, "task name"),
                      _fixed(group or "", layout.GROUP_BYTES, "group id"), group is not None)
        meta = np.frombuffer(metadata_json.encode("utf-8"), np.uint8)
        meta_start = self._push("blobs/metadata", meta, len(meta))
        self._rows[trajectory_id] = self._push(
            "trajectories", (*row_values, time.time() if created is None else created, meta_start, len(meta)), 1)
        self.stats.trajectories += 1
        self.stats.seconds_buffering += time.perf_counter() - began

    def add_segment(self, trajectory_id: str, segment: Segment) -> None:
        """Append the trajectory's next segment (segments are recorded in index order)."""
        began = time.perf_counter()
        self._check_open()
        row = self._row(trajectory_id)
        index = self._segments_of[row]
        n = len(segment)
        start = self._push("tokens/ids", segment.tokens, n)
        self._push("tokens/logprobs", segment.logprobs, n)
        self._push("tokens/versions", segment.versions, n)
        values: tuple[Any, ...] = (row, index, segment.parent, segment.fork_at, segment.kind.code, start, n,
                  _fixed_cached(segment.engine, layout.ENGINE_BYTES, "engine name"), segment.t_start, segment.t_end,
                  _fixed_cached(segment.finish_reason, layout.REASON_BYTES, "finish reason"))
        if self._sampling:  # (a schema-1 store, reopened, has no place for them)
            values += (_NONE if segment.temperature is None else segment.temperature,
                       _NONE if segment.top_p is None else segment.top_p)
        self._push("segments", values, 1)
        self._segments_of[row] = index + 1
        self.stats.tokens += n
        self.stats.seconds_buffering += time.perf_counter() - began

    def set_status(self, trajectory_id: str, status: Status | str, *, when: float | None = None,
                   reward: float | None = None, turn_rewards: Sequence[float] = (), reason: str = "") -> None:
        """Append a status record; it supersedes the trajectory's earlier ones. A FAILED record carries
        `reason` (and no rewards); no other status takes one."""
        began = time.perf_counter()
        self._check_open()
        row = self._row(trajectory_id)
        status = Status(status)
        if status is Status.FAILED:
            if reward is not None or len(turn_rewards):
                raise InvalidRequest(f"{self.path}: a failed trajectory has no rewards ({trajectory_id!r})")
            text = np.frombuffer(reason.encode("utf-8"), np.uint8)
            start, count = (self._push("blobs/metadata", text, len(text)) if len(text) else 0), len(text)
        else:
            if reason:
                raise InvalidRequest(f"{self.path}: only a failed trajectory has a reason, not a {status} one")
            rewards = np.asarray(turn_rewards, np.float64)
            start, count = (self._push("blobs/rewards", rewards, len(rewards)) if len(rewards) else 0), len(rewards)
        self._push("statuses", (row, status.code, time.time() if when is None else when,
                                _NONE if reward is None else float(reward), start, count), 1)
        self.stats.seconds_buffering += time.perf_counter() - began

    def mark_consumed(self, step: int, trajectory_ids: Iterable[str], *, policy_version: int,
                      when: float | None = None) -> None:
        """Record that training step `step` used these trajectories."""
        self._check_open()
        now = time.time() if when is None else when
        for trajectory_id in trajectory_ids:
            self._push("marks", (step, self._row(trajectory_id), policy_version, now), 1)

    @property
    def records_timeline(self) -> bool:
        """Whether this store keeps the ranks' timeline (a schema-1 store, reopened, does not)."""
        return self._layout.has("timeline")

    def add_intervals(self, intervals: Iterable[RankInterval]) -> None:
        """Append state intervals of ranks to the timeline (dropped when the store's schema has none)."""
        self._check_open()
        if not self.records_timeline:
            return
        for i in intervals:
            self._push("timeline", (i.rank, _fixed_cached(i.role, layout.ROLE_BYTES, "rank role"),
                                    _fixed_cached(i.state, layout.STATE_BYTES, "rank state"), i.t_start, i.t_end,
                                    i.step), 1)

    @property
    def records_scores(self) -> bool:
        """Whether this store keeps per-token scores (a store of schema 2 or older, reopened, does not)."""
        return self._layout.has("scores")

    def add_scores(self, step: int, scorer: str, scores: Iterable[tuple[str, np.ndarray]]) -> None:
        """Per-token scores of trajectories trained at `step` (``(trajectory id, one value per token of its
        trained branch)``), from `scorer`; dropped when the store's schema has no scores."""
        self._check_open()
        if not self.records_scores:
            return
        name = _fixed_cached(scorer, layout.SCORER_BYTES, "scorer")
        for trajectory_id, values in scores:
            values = np.asarray(values, np.float32)
            start = self._push("blobs/scores", values, len(values))
            self._push("scores", (step, self._row(trajectory_id), name, start, len(values)), 1)

    def write(self, trajectory: Trajectory) -> None:
        """Record a whole trajectory at once: header, every segment, its status (and rewards)."""
        self.add_trajectory(trajectory.id, task=trajectory.task, group=trajectory.group,
                            metadata_json=trajectory.metadata_json, created=trajectory.created)
        for segment in trajectory.segments:
            self.add_segment(trajectory.id, segment)
        self.set_status(trajectory.id, trajectory.status, when=trajectory.updated, reward=trajectory.reward,
                        turn_rewards=trajectory.turn_rewards, reason=trajectory.fail_reason)

    # -- flushing ----------------------------------------------------------------------------------------

    @property
    def has_pending(self) -> bool:
        return any(self._pending.values())

    def flush(self) -> None:
        """Write everything buffered, data first and the commit row last, and flush the file."""
        self._check_open()
        if not self.has_pending:
            return
        began = time.perf_counter()
        try:
            for name, dtype in self._layout.growing.items():  # DATA before TABLES: rows never point at missing data
                pending = self._pending[name]
                if not pending:
                    continue
                values = np.concatenate(pending) if name in self._layout.data else np.array(pending, dtype=dtype)
                dataset, start = self._ds[name], self._committed[name]
                dataset.resize((start + len(values),))
                dataset[start:] = values
                dataset.flush()
                self._committed[name] = start + len(values)
                pending.clear()
            append_commit(self._ds[layout.COMMITS], self._committed, session=self.session)
            self._file.flush()
        # What is not committed stays buffered; a later flush may still succeed. HDF5 reports a failed write
        # as OSError or RuntimeError (a flush of a dataset's chunks), the system's errno in its message.
        except (OSError, RuntimeError) as exc:
            raise write_error(self.path, exc, "records since the last flush are not on disk yet") from None
        self.stats.flushes += 1
        self.stats.seconds_flushing += time.perf_counter() - began

    def view(self) -> StoreView:
        """What this writer has committed so far, read back (a restarted manager loads its state from it)."""
        self._check_open()
        return StoreView(self.path, self._file, follow=False)

    def close(self) -> None:
        """Flush and close; the store can be reopened to append later."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            try:
                self._file.close()
            except (OSError, RuntimeError) as exc:
                # After a failed flush (a full disk) closing fails the same way: the flush's error is the one
                # to tell, and the file still reopens at its last commit.
                if not self.has_pending:
                    raise write_error(self.path, exc, "its last records may not be on disk") from None
            finally:
                release_writer_lock(self._lock_fd)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self.path}: the store was closed; reopen it to append")

    def __enter__(self) -> TrajectoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How HDF5 quotes the system's error inside its own (h5py raises RuntimeError or OSError with this text).
_NO_SPACE_TEXT = re.compile(r"errno = (28|122)\b|no space left on device|disk quota exceeded", re.IGNORECASE)


def write_error(path: Path, exc: BaseException, lost: str) -> StoreError:
    """The one-line error of a write to the store at `path` that failed with `exc`: `StoreFull` for a full disk
    (or spent quota), which says so and what to do, else `StoreError` quoting HDF5's first line. `lost`: what
    the failure leaves unwritten."""
    if (isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS) or _NO_SPACE_TEXT.search(str(exc)):
        free = ""
        with contextlib.suppress(OSError):
            free = f"; {shutil.disk_usage(path.parent).free / 2**20:.1f} MiB free on its file system"
        return StoreFull(f"{path}: cannot write the trajectory store (No space left on device{free}); {lost}; "
                         "free space (or quota) there, and a restarted run resumes from its last checkpoint")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return StoreError(f"{path}: writing failed ({first}); {lost}")


def append_commit(commits: h5py.Dataset, counts: dict[str, int], *, session: int) -> None:
    row = np.zeros(1, commits.dtype)  # the file's own schema
    row["time"], row["session"] = time.time(), session
    for name, count in counts.items():
        row[name.replace("/", ".")] = count
    n = commits.shape[0]
    commits.resize((n + 1,))
    commits[n:] = row
    commits.flush()


def _start_session(file: h5py.File, counts: dict[str, int], *, session: int) -> None:
    """A writer session begins: its first commit row (what is complete so far), then SWMR on, which from
    here on lets readers follow while no new object or attribute can be created."""
    append_commit(file[layout.COMMITS], counts, session=session)
    file.swmr_mode = True
    file.flush()
