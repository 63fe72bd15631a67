"""Reading a trajectory store: its committed content, table by table, followed while its run writes it.

`open_store` opens a store read-only in SWMR mode, so a reader can follow a run while the writer appends
(`StoreView.refresh`). Only what the last commit row counts is read (see `sfhpc.data.layout`). A file that
is not a store, is damaged, or was written by a newer sfhpc is refused with a `StoreError` that names it.
Files of an older schema read as the current one (fields they lack are unknown, tables they lack empty).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from sfhpc.data import layout
from sfhpc.data.errors import StoreError, UnknownTrajectory
from sfhpc.data.h5native import CRASHED_WRITER_MESSAGE, open_reader
from sfhpc.data.rank_intervals import BubbleFraction, bubble_of_rows
from sfhpc.data.trajectory import Segment, SegmentKind, Status, Trajectory
from sfhpc.table import format_table

_text = layout.decode_text

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
    bubble: BubbleFraction | None = None  # None: the store's schema has no timeline

    def format(self) -> str:
        rows = [("path", self.path), ("schema", str(self.schema)), ("writer sessions", str(self.sessions)),
                ("trajectories", str(self.trajectories))]
        rows += [(f"  {status}", str(n)) for status, n in self.by_status.items() if n]
        rows += [("segments", str(self.segments)), ("tokens", str(self.tokens)),
                 ("generated tokens", str(self.generated_tokens)), ("training steps", str(self.steps)),
                 ("mean reward", "-" if self.mean_reward is None else f"{self.mean_reward:.4f}")]
        if self.first_time is not None and self.last_time is not None:
            rows.append(("span", f"{self.last_time - self.first_time:.1f} s"))
        rows.append(("bubble fraction", "not recorded" if self.bubble is None else self.bubble.format()))
        return format_table(("store", ""), rows)


def describe_open_failure(path: Path, exc: BaseException) -> StoreError:
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


def check_layout(path: Path, file: h5py.File) -> int:
    """Raise StoreError unless `file` is a store this sfhpc can read (of any schema up to the current one);
    returns its schema version."""
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
    if schema < 1:
        raise StoreError(f"{path}: has store schema {schema}, which no sfhpc wrote; the file is damaged")
    for name, dtype in layout.schema(schema).datasets.items():
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
        self._layout = layout.schema(int(file.attrs[layout.SCHEMA_ATTR]))
        self._ds = {name: file[name] for name in self._layout.datasets}
        # Every table of the current schema, in its current row type (a table an older file lacks stays empty).
        self._tables = {name: np.zeros(0, dtype) for name, dtype in layout.TABLES.items()}
        self._counts = dict.fromkeys(self._layout.growing, 0)
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
        counts = {name: int(last[name.replace("/", ".")]) for name in self._layout.growing}
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
        for name in self._layout.tables:  # append-only: read just the new rows
            old, new = self._counts[name], counts[name]
            if new > old:  # (the first read is kept as it is: a copy would double a big table's memory)
                rows = layout.upgraded(name, self._ds[name][old:new])
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
        return self._layout.version

    @property
    def records_timeline(self) -> bool:
        """Whether the file's schema has the ranks' timeline (version 2 on)."""
        return self._layout.has("timeline")

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

    def scores(self, trajectory_id: str, scorer: str = "teacher") -> dict[int, np.ndarray]:
        """Training step -> `scorer`'s per-token scores of the trajectory's trained branch (the distillation
        teacher's log-probabilities, one per token of ``Trajectory.context()``, 0 at the first); empty when
        nothing scored it (or the file's schema, before version 3, has no scores)."""
        row = self._rows.get(trajectory_id)
        if row is None:
            raise UnknownTrajectory(f"{self.path}: no trajectory with id {trajectory_id!r}")
        table = self._tables["scores"]
        mine = table[(table["trajectory"] == row) & (table["scorer"] == scorer.encode("utf-8"))]
        return {int(r["step"]): self._read("blobs/scores", int(r["start"]), int(r["start"] + r["count"]))
                for r in mine}

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
        """Every committed row of `trajectories`, `segments`, `statuses`, `marks`, `timeline` or `scores`,
        read-only, in the current schema's row types (for an older file: unknown fields NaN, a table it lacks
        empty)."""
        rows = self._tables[name].view()
        rows.flags.writeable = False
        return rows

    def bubble(self) -> BubbleFraction:
        """The bubble fraction of the recorded timeline (``format()`` says "not recorded" when it is empty)."""
        return bubble_of_rows(self._tables["timeline"])

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
        return self._ds[name][start:stop] if stop > start else np.zeros(0, self._layout.growing[name])

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
                                    float(seg["t_end"]), _text(seg["finish_reason"]),
                                    float(seg["temperature"]), float(seg["top_p"])))  # NaN reads as None
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
            path=str(self.path), schema=self.schema, sessions=self._session,
            trajectories=len(self), by_status={s.value: by_status.get(s, 0) for s in Status},
            segments=len(segments), tokens=self._counts["tokens/ids"],
            generated_tokens=int(segments["token_count"][generated].sum()),
            steps=len(np.unique(marks["step"])), last_step=int(marks["step"].max()) if len(marks) else None,
            mean_reward=float(np.mean(rewards)) if rewards else None,
            first_time=float(min(times)) if times else None, last_time=float(max(times)) if times else None,
            bubble=self.bubble() if self.records_timeline else None)


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


def open_readonly(path: Path) -> h5py.File:
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
            raise describe_open_failure(path, exc) from None
    try:
        return open_reader(path, swmr=True)
    except OSError as exc:
        raise describe_open_failure(path, exc) from None


def open_store(path: str | os.PathLike[str]) -> StoreReader:
    """Open a store for reading (SWMR: the run may still be writing it). Call `refresh()` to follow it."""
    path = Path(path)
    file = open_readonly(path)
    try:
        check_layout(path, file)
        return StoreReader(path, file, follow=True)
    except StoreError:
        file.close()
        raise
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        file.close()
        raise describe_open_failure(path, exc) from None
