"""The trajectory store: one HDF5 file per run, one writer (the controller), any number of readers.

The writer (`TrajectoryStore`) buffers records in memory and writes them at `flush()`, the data before
the rows that point into it and a commit row last (see `sfhpc.data.layout`). The file is in SWMR mode,
so readers (`open_store`) can follow a run while it writes, and a writer killed at any moment leaves a
file that reopens with every flushed trajectory intact.

sfhpc never overwrites an existing file: `create` refuses a path that exists, `reopen` appends to it.
One writer at a time is enforced with a lock file beside the store (``RUN.h5.lock``, empty, kept), held
while a writer has the store open and released by the kernel if the writer dies.
A file that is not a store, is damaged, or was written by a newer sfhpc is refused with a `StoreError`
that names it, before anything is written to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import json
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from sfhpc.data import layout
from sfhpc.data.errors import InvalidRequest, StoreError, StoreExists, UnknownTrajectory
from sfhpc.data.h5native import CRASHED_WRITER_MESSAGE, open_clearing_crash_mark, open_reader
from sfhpc.data.trajectory import Segment, SegmentKind, Status, Trajectory
from sfhpc.table import format_table

_NONE = float("nan")  # how "no reward" is stored


def _fixed(value: str, size: int, what: str) -> bytes:
    data = value.encode("utf-8")
    if len(data) > size:
        raise InvalidRequest(f"{what} {value[:40]!r}... is {len(data)} bytes long; the store holds at most {size}")
    return data


@functools.lru_cache(maxsize=1024)
def _fixed_cached(value: str, size: int, what: str) -> bytes:
    """`_fixed` for the few values that repeat in every row (engine names, finish reasons)."""
    return _fixed(value, size, what)


def _text(value: bytes) -> str:
    return value.decode("utf-8")


def lock_path(path: Path) -> Path:
    """The writer's lock file next to the store (empty; held while a writer has the store open)."""
    return path.with_name(path.name + ".lock")


# ---------------------------------------------------------------------------------------------------
# Reading


@dataclasses.dataclass(frozen=True)
class ConsumptionMark:
    """One training step used one trajectory."""

    step: int
    trajectory_id: str
    policy_version: int
    time: float


@dataclasses.dataclass(frozen=True)
class StoreSummary:
    """What a store holds, in numbers (`sfhpc traj summary`)."""

    path: str
    schema: int
    sessions: int  # how many processes have written it (1 + restarts)
    trajectories: int
    by_status: dict[str, int]
    segments: int
    tokens: int  # every recorded token, all branches
    generated_tokens: int
    steps: int  # training steps that consumed something
    last_step: int | None
    mean_reward: float | None  # over finished and consumed trajectories with a reward
    first_time: float | None
    last_time: float | None

    def format(self) -> str:
        rows = [("path", self.path), ("schema", str(self.schema)), ("writer sessions", str(self.sessions)),
                ("trajectories", str(self.trajectories))]
        rows += [(f"  {status}", str(n)) for status, n in self.by_status.items() if n]
        rows += [("segments", str(self.segments)), ("tokens", str(self.tokens)),
                 ("generated tokens", str(self.generated_tokens)), ("training steps", str(self.steps)),
                 ("mean reward", "-" if self.mean_reward is None else f"{self.mean_reward:.4f}")]
        if self.first_time is not None and self.last_time is not None:
            rows.append(("span", f"{self.last_time - self.first_time:.1f} s"))
        return format_table(("store", ""), rows)


def _describe_open_failure(path: Path, exc: BaseException) -> StoreError:
    message = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    if "signature not found" in message:
        what = "is not an HDF5 file"
    elif "truncated file" in message:
        what = "is truncated (shorter than its HDF5 header says: an interrupted copy or a full disk?)"
    elif "unable to lock file" in message:
        what = ("is locked by another program that opened it with HDF5 file locking (h5py without "
                "swmr=True?); close that program, or read the store with sfhpc's open_store")
    else:
        what = f"is damaged or not readable as HDF5 ({message.strip() or type(exc).__name__})"
    return StoreError(f"{path}: {what}; the file was left as it is")


def _check_layout(path: Path, file: h5py.File) -> int:
    """Raise StoreError unless `file` is a store this sfhpc can read; returns its schema version."""
    kind = file.attrs.get(layout.KIND_ATTR)
    schema = file.attrs.get(layout.SCHEMA_ATTR)
    if kind is None or schema is None:
        raise StoreError(f"{path}: is an HDF5 file but not an sfhpc trajectory store "
                         f"(no '{layout.SCHEMA_ATTR}' attribute); pass the run's store file")
    if isinstance(kind, bytes):
        kind = kind.decode()
    if kind != layout.KIND:
        raise StoreError(f"{path}: holds an sfhpc '{kind}', not a trajectory store")
    schema = int(schema)
    if schema > layout.SCHEMA_VERSION:
        raise StoreError(f"{path}: was written by a newer sfhpc (store schema {schema}; this sfhpc reads up to "
                         f"{layout.SCHEMA_VERSION}); upgrade sfhpc to read it")
    expected = {**layout.GROWING, layout.COMMITS: layout.COMMIT_DTYPE}
    for name, dtype in expected.items():
        dataset = file.get(name)
        if not isinstance(dataset, h5py.Dataset):
            raise StoreError(f"{path}: store schema {schema} but dataset '/{name}' is missing; the file is damaged")
        if dataset.dtype != dtype or dataset.ndim != 1:
            raise StoreError(f"{path}: dataset '/{name}' has type {dataset.dtype} (expected {dtype}); "
                             "the file is damaged or was not written by sfhpc")
    return schema


class StoreView:
    """The committed content of an open store file, read table by table, followed as the file grows."""

    def __init__(self, path: Path, file: h5py.File, *, follow: bool) -> None:
        self.path, self._file, self._follow = path, file, follow
        self._ds = {name: file[name] for name in (*layout.GROWING, layout.COMMITS)}
        self._tables = {name: np.zeros(0, dtype) for name, dtype in layout.TABLES.items()}
        self._counts = dict.fromkeys(layout.GROWING, 0)
        self._session = 0
        self._rows: dict[str, int] = {}
        self._derived: dict[str, Any] | None = None
        self.refresh()

    # -- following the file ---------------------------------------------------------------------------

    def refresh(self) -> bool:
        """Catch up with what the writer has committed since the last call; True when something is new."""
        try:
            return self._refresh()
        except (OSError, KeyError, ValueError, RuntimeError) as exc:
            raise StoreError(f"{self.path}: cannot be read ({exc}); the file is damaged") from None

    def _refresh(self) -> bool:
        commits = self._ds[layout.COMMITS]
        if self._follow:
            commits.refresh()
        if commits.shape[0] == 0:
            raise StoreError(f"{self.path}: holds no commit record (its writer died while creating it); "
                             "start the run with a new store path")
        last = commits[commits.shape[0] - 1]
        counts = {name: int(last[name.replace("/", ".")]) for name in layout.GROWING}
        self._session = int(last["session"])
        if counts == self._counts:
            return False
        for name, count in counts.items():
            dataset = self._ds[name]
            if self._follow:
                dataset.refresh()
            if dataset.shape[0] < count or count < self._counts[name]:
                raise StoreError(f"{self.path}: the last commit counts {count} elements in '/{name}' but it holds "
                                 f"{dataset.shape[0]}; the file is damaged")
        for name in layout.TABLES:  # append-only: read just the new rows
            old, new = self._counts[name], counts[name]
            if new > old:  # (the first read is kept as it is: a copy would double a big table's memory)
                rows = self._ds[name][old:new]
                self._tables[name] = rows if old == 0 else np.concatenate([self._tables[name], rows])
        new_rows = self._tables["trajectories"][self._counts["trajectories"]:counts["trajectories"]]
        start = self._counts["trajectories"]
        for offset, raw_id in enumerate(new_rows["id"]):
            self._rows[_text(raw_id)] = start + offset
        self._counts = counts
        self._derived = None
        return True

    @property
    def counts(self) -> dict[str, int]:
        """Committed elements per dataset (`tokens/ids`, `trajectories`, `segments`, ...)."""
        return dict(self._counts)

    @property
    def session(self) -> int:
        return self._session

    @property
    def schema(self) -> int:
        """The layout version the file was written with."""
        return int(self._file.attrs[layout.SCHEMA_ATTR])

    def _index(self) -> dict[str, Any]:
        """Lookups rebuilt after a refresh: segments per trajectory, latest status per trajectory."""
        if self._derived is None:
            segments, statuses = self._tables["segments"], self._tables["statuses"]
            n = self._counts["trajectories"]
            order = np.argsort(segments["trajectory"], kind="stable")  # stable: keeps index order
            bounds = np.searchsorted(segments["trajectory"][order], np.arange(n + 1))
            latest = np.full(n, -1, np.int64)
            np.maximum.at(latest, statuses["trajectory"], np.arange(len(statuses), dtype=np.int64))
            self._derived = {"order": order, "bounds": bounds, "latest": latest}
        return self._derived

    # -- queries ---------------------------------------------------------------------------------------

    def ids(self) -> list[str]:
        """Every trajectory id, in the order they were started."""
        return list(self._rows)

    def __contains__(self, trajectory_id: str) -> bool:
        return trajectory_id in self._rows

    def __len__(self) -> int:
        return self._counts["trajectories"]

    def statuses(self) -> dict[str, Status]:
        """The current status of every trajectory (its latest status record)."""
        codes = self._tables["statuses"]["status"]
        latest = self._index()["latest"]
        return {tid: (Status.from_code(int(codes[latest[row]])) if latest[row] >= 0 else Status.RUNNING)
                for tid, row in self._rows.items()}

    def marks(self) -> list[ConsumptionMark]:
        ids = self._tables["trajectories"]["id"]
        return [ConsumptionMark(int(m["step"]), _text(ids[m["trajectory"]]), int(m["policy_version"]),
                                float(m["time"])) for m in self._tables["marks"]]

    def get(self, trajectory_id: str) -> Trajectory:
        """The trajectory as last committed; raises UnknownTrajectory."""
        row = self._rows.get(trajectory_id)
        if row is None:
            raise UnknownTrajectory(f"{self.path}: no trajectory with id {trajectory_id!r}")
        return self._assemble(row)

    def trajectories(self, status: Status | str | Iterable[Status | str] | None = None) -> Iterator[Trajectory]:
        """Every trajectory (or those whose current status is among `status`), in start order."""
        wanted = None
        if status is not None:
            wanted = {Status(status)} if isinstance(status, str) else {Status(s) for s in status}
        codes = self._tables["statuses"]["status"]
        latest = self._index()["latest"]
        for row in range(self._counts["trajectories"]):
            if wanted is not None:
                current = Status.from_code(int(codes[latest[row]])) if latest[row] >= 0 else Status.RUNNING
                if current not in wanted:
                    continue
            yield self._assemble(row)

    # -- whole tables, for analyses over every record at once (sfhpc.analysis) --------------------------

    def table(self, name: str) -> np.ndarray:
        """Every committed row of `trajectories`, `segments`, `statuses` or `marks`, read-only."""
        rows = self._tables[name].view()
        rows.flags.writeable = False
        return rows

    def latest_status_rows(self) -> np.ndarray:
        """Per trajectory row: the row of its latest record in ``table("statuses")``; -1 for none yet."""
        return self._index()["latest"]

    def data(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Committed elements [start, stop) of a data array (``tokens/versions``, ``blobs/metadata`` ...)."""
        stop = self._counts[name] if stop is None else min(stop, self._counts[name])
        return self._read(name, start, stop)

    def resumable(self) -> list[Trajectory]:
        """Trajectories a restarted run must continue: running (the writer died under them) or interrupted."""
        return list(self.trajectories((Status.RUNNING, Status.INTERRUPTED)))

    def unconsumed(self) -> list[Trajectory]:
        """Finished trajectories no training step has used yet."""
        return list(self.trajectories(Status.FINISHED))

    def _read(self, name: str, start: int, stop: int) -> np.ndarray:
        return self._ds[name][start:stop] if stop > start else np.zeros(0, layout.GROWING[name])

    def _assemble(self, row: int) -> Trajectory:
        index = self._index()
        record = self._tables["trajectories"][row]
        seg_rows = self._tables["segments"][index["order"][index["bounds"][row]:index["bounds"][row + 1]]]
        starts, counts = seg_rows["token_start"], seg_rows["token_count"]
        columns: dict[str, np.ndarray] = {}
        if len(seg_rows):
            # One read per column over the trajectory's span, unless its segments lie far apart in the file.
            low, high = int(starts.min()), int((starts + counts).max())
            if high - low <= 4 * max(1, int(counts.sum())):
                for name in ("tokens/ids", "tokens/logprobs", "tokens/versions"):
                    columns[name] = self._read(name, low, high)
                starts = starts - low
        segments = []
        for i, seg in enumerate(seg_rows):
            if int(seg["index"]) != i:
                raise StoreError(f"{self.path}: trajectory {_text(record['id'])!r} has segment {seg['index']} "
                                 f"where segment {i} belongs; the file is damaged")
            a, b = int(starts[i]), int(starts[i] + counts[i])
            ids, lps, vers = ((columns[n][a:b] if columns else self._read(n, a, b))
                              for n in ("tokens/ids", "tokens/logprobs", "tokens/versions"))
            segments.append(Segment(SegmentKind.from_code(int(seg["kind"])), int(seg["parent"]), int(seg["fork_at"]),
                                    ids, lps, vers, _text(seg["engine"]), float(seg["t_start"]),
                                    float(seg["t_end"]), _text(seg["finish_reason"])))
        meta = self._read("blobs/metadata", int(record["meta_start"]),
                          int(record["meta_start"] + record["meta_count"]))
        status, reward, turn_rewards, updated = Status.RUNNING, None, (), float(record["created"])
        reason = ""
        latest = int(index["latest"][row])
        if latest >= 0:
            rec = self._tables["statuses"][latest]
            status, updated = Status.from_code(int(rec["status"])), float(rec["time"])
            reward = None if np.isnan(rec["reward"]) else float(rec["reward"])
            start, stop = int(rec["rewards_start"]), int(rec["rewards_start"] + rec["rewards_count"])
            if status is Status.FAILED:  # its record points at the reason (see sfhpc.data.layout)
                reason = self._read("blobs/metadata", start, stop).tobytes().decode("utf-8")
            else:
                turn_rewards = tuple(self._read("blobs/rewards", start, stop).tolist())
        return Trajectory(id=_text(record["id"]), segments=tuple(segments), task=_text(record["task"]),
                          group=_text(record["group"]) if record["has_group"] else None, status=status,
                          reward=reward, turn_rewards=turn_rewards, metadata_json=meta.tobytes().decode("utf-8"),
                          created=float(record["created"]), updated=updated, fail_reason=reason)

    def summary(self) -> StoreSummary:
        segments, marks = self._tables["segments"], self._tables["marks"]
        statuses = self.statuses()
        by_status = Counter(statuses.values())
        latest = self._index()["latest"]
        recs = self._tables["statuses"]
        rewards = [float(recs[latest[row]]["reward"]) for tid, row in self._rows.items()
                   if latest[row] >= 0 and statuses[tid] in (Status.FINISHED, Status.CONSUMED)]
        rewards = [r for r in rewards if not np.isnan(r)]
        generated = segments["kind"] == SegmentKind.GENERATED.code
        created = self._tables["trajectories"]["created"]
        times = [t for t in (created.min() if len(created) else None, recs["time"].max() if len(recs) else None)
                 if t is not None]
        return StoreSummary(
            path=str(self.path), schema=int(self._file.attrs[layout.SCHEMA_ATTR]), sessions=self._session,
            trajectories=len(self), by_status={s.value: by_status.get(s, 0) for s in Status},
            segments=len(segments), tokens=self._counts["tokens/ids"],
            generated_tokens=int(segments["token_count"][generated].sum()),
            steps=len(np.unique(marks["step"])), last_step=int(marks["step"].max()) if len(marks) else None,
            mean_reward=float(np.mean(rewards)) if rewards else None,
            first_time=float(min(times)) if times else None, last_time=float(max(times)) if times else None)


class StoreReader(StoreView):
    """A read-only, SWMR view of a store: safe while the run writes it. Use `open_store`."""

    @property
    def run_metadata(self) -> dict[str, Any]:
        return json.loads(self._file.attrs.get(layout.RUN_ATTR, "{}"))

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_readonly(path: Path) -> h5py.File:
    if not path.exists():
        raise StoreError(f"{path}: no such file")
    if not path.is_file():
        raise StoreError(f"{path}: is not a file")
    # First a plain open, as a probe: it checks what a SWMR open skips (a file shorter than its header
    # says). It fails on a file a writer has open (or was killed with open); only then is SWMR the way in.
    try:
        open_reader(path, swmr=False).close()
    except OSError as exc:
        if CRASHED_WRITER_MESSAGE not in str(exc):
            raise _describe_open_failure(path, exc) from None
    try:
        return open_reader(path, swmr=True)
    except OSError as exc:
        raise _describe_open_failure(path, exc) from None


def open_store(path: str | os.PathLike[str]) -> StoreReader:
    """Open a store for reading (SWMR: the run may still be writing it). Call `refresh()` to follow it."""
    path = Path(path)
    file = _open_readonly(path)
    try:
        _check_layout(path, file)
        return StoreReader(path, file, follow=True)
    except StoreError:
        file.close()
        raise
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        file.close()
        raise _describe_open_failure(path, exc) from None


# ---------------------------------------------------------------------------------------------------
# Writing


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
        self._ds = {name: file[name] for name in (*layout.GROWING, layout.COMMITS)}
        commits = self._ds[layout.COMMITS]
        last = commits[commits.shape[0] - 1]
        self._committed = {name: int(last[name.replace("/", ".")]) for name in layout.GROWING}
        self._next = dict(self._committed)  # lengths including what is buffered
        self._pending: dict[str, list[Any]] = {name: [] for name in layout.GROWING}
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
        lock_fd = _take_lock(path)
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
            for name, dtype in {**layout.GROWING, layout.COMMITS: layout.COMMIT_DTYPE}.items():
                file.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(layout.chunk_of(name),))
            _append_commit(file[layout.COMMITS], dict.fromkeys(layout.GROWING, 0), session=1)
            file.swmr_mode = True
            file.flush()
        except BaseException:
            _release_lock(lock_fd)
            raise
        return cls(path, file, lock_fd)

    @classmethod
    def reopen(cls, path: str | os.PathLike[str]) -> TrajectoryStore:
        """Reopen an existing store to append to it (a restarted run), also after its writer was killed.

        Elements past the last commit (a flush the old writer did not finish) are dropped.
        """
        path = Path(path)
        with contextlib.closing(_open_readonly(path)) as probe:  # validate before anything is written
            try:
                _check_layout(path, probe)
                StoreView(path, probe, follow=True)
            except (OSError, KeyError, ValueError, RuntimeError) as exc:
                raise _describe_open_failure(path, exc) from None
        lock_fd = _take_lock(path)
        try:
            try:
                file = h5py.File(path, "r+", libver="latest", locking=False)
            except OSError as exc:
                if CRASHED_WRITER_MESSAGE not in str(exc):
                    raise _describe_open_failure(path, exc) from None
                # We hold the writer lock, so the writer that left the mark is gone: clear it, as h5clear would.
                try:
                    file = open_clearing_crash_mark(path)
                except OSError as exc2:
                    raise StoreError(f"{path}: its last writer was killed and the file cannot be reopened for "
                                     f"writing ({exc2}); run `h5clear -s {path}` and retry") from None
            commits = file[layout.COMMITS]
            last = commits[commits.shape[0] - 1]
            counts = {name: int(last[name.replace("/", ".")]) for name in layout.GROWING}
            for name, count in counts.items():
                if file[name].shape[0] != count:
                    file[name].resize((count,))  # the uncommitted tail of a flush that never finished
            _append_commit(commits, counts, session=int(last["session"]) + 1)
            file.swmr_mode = True
            file.flush()
        except BaseException:
            _release_lock(lock_fd)
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
        self._push("segments", (row, index, segment.parent, segment.fork_at, segment.kind.code, start, n,
                                _fixed_cached(segment.engine, layout.ENGINE_BYTES, "engine name"), segment.t_start,
                                segment.t_end,
                                _fixed_cached(segment.finish_reason, layout.REASON_BYTES, "finish reason")), 1)
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
            for name, dtype in layout.GROWING.items():  # DATA before TABLES: rows never point at missing data
                pending = self._pending[name]
                if not pending:
                    continue
                values = np.concatenate(pending) if name in layout.DATA else np.array(pending, dtype=dtype)
                dataset, start = self._ds[name], self._committed[name]
                dataset.resize((start + len(values),))
                dataset[start:] = values
                dataset.flush()
                self._committed[name] = start + len(values)
                pending.clear()
            _append_commit(self._ds[layout.COMMITS], self._committed, session=self.session)
            self._file.flush()
        except OSError as exc:  # what is not committed stays buffered; a later flush may still succeed
            raise StoreError(f"{self.path}: writing failed ({exc}); records since the last flush are not on "
                             "disk yet (is the disk full?)") from None
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
            self._file.close()
        finally:
            self._closed = True
            _release_lock(self._lock_fd)

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


def _append_commit(commits: h5py.Dataset, counts: dict[str, int], *, session: int) -> None:
    row = np.zeros(1, layout.COMMIT_DTYPE)
    row["time"], row["session"] = time.time(), session
    for name, count in counts.items():
        row[name.replace("/", ".")] = count
    n = commits.shape[0]
    commits.resize((n + 1,))
    commits[n:] = row
    commits.flush()


def _take_lock(path: Path) -> int:
    """Hold the store's writer lock (a lock file beside it) so no two processes ever write one store.

    The lock cannot be on the HDF5 file itself: SWMR readers take a shared lock on that file.
    The kernel drops the lock when the process dies, so a killed writer never blocks its restart.
    """
    lock = lock_path(path)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise StoreError(f"{path}: cannot create its writer lock {lock} ({exc.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise StoreError(f"{path}: another process is writing this store (it holds {lock}); "
                         "a store has one writer: stop that run first") from None
    return fd


def _release_lock(fd: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
