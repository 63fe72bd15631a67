"""The per-trajectory columns of a whole store at once: numpy over whole tables, not a loop over records.

Assembling one `Trajectory` costs tens of microseconds, so a store of a million takes minutes that way;
an analyst's summary should take seconds. `store_columns` reads each table once and derives every
column of `trajectory_row` (the definition these columns must equal) with array operations.

A trajectory whose segments form one chain (each segment continues the previous one in full) has every
segment on its current branch: the fast path covers it. One with a fork (an earlier context taken up
again) is assembled and goes through `trajectory_row` itself; runs have few of those.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd

from sfhpc.analysis.trajectories import trajectory_row
from sfhpc.data.store import ConsumptionMark, StoreView
from sfhpc.data.trajectory import NO_VERSION, SegmentKind, Status, agent_of, episode_of

GENERATED = SegmentKind.GENERATED.code
FAILED = Status.FAILED.code
SEGMENTS_PER_READ = 1 << 20  # generated segments whose token versions are read at once (bounds the memory)
STATUS_NAMES = np.array([s.value for s in Status], dtype=object)


@dataclasses.dataclass(frozen=True)
class StoreColumns:
    """What `store_columns` computes: the columns, and who wrote which tokens."""

    columns: dict[str, np.ndarray | list]  # TRAJECTORY_DTYPES' names; NaN / -1 / None where missing
    version_pairs: np.ndarray  # unique (trajectory row, policy version): versions that wrote its branch
    tokens_by_version: dict[int, int]  # generated tokens on the current branches, per policy version


def store_columns(store: StoreView) -> StoreColumns:
    """Every trajectory's `trajectory_row` columns, as arrays in store row order (start order)."""
    n = len(store)
    records = store.table("trajectories")
    table = store.table("segments")
    owner = table["trajectory"]
    # Segments are recorded in index order, so a stable sort by trajectory lists each one's in order; a store
    # written by one agent at a time is sorted already (no copy then).
    order = None if np.all(owner[1:] >= owner[:-1]) else np.argsort(owner, kind="stable")

    def field(name: str) -> np.ndarray:
        return table[name] if order is None else table[name][order]

    owner, index, count = field("trajectory"), field("index").astype(np.int64), field("token_count")
    generated = field("kind") == GENERATED
    aborted = table["finish_reason"] == b"abort"  # compared before reordering: no copy of the text column
    aborted = aborted if order is None else aborted[order]

    # A chain: segment 0 is the root; segment i > 0 has parent i - 1 and forks at the parent's end.
    same = np.r_[False, owner[1:] == owner[:-1]]
    prev_index, prev_count = np.r_[-1, index[:-1]], np.r_[0, count[:-1]]
    parent, fork_at = field("parent"), field("fork_at")
    chain = np.where(index == 0, (parent == -1) & (fork_at == 0),
                     same & (index == prev_index + 1) & (parent == index - 1) & (fork_at == prev_count))
    del parent, fork_at, prev_index
    forked = np.zeros(n, bool)
    forked[owner[~chain]] = True
    keep = ~forked[owner]

    def per_trajectory(mask: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        w = None if weights is None else weights[mask].astype(np.float64)
        return np.bincount(owner[mask], weights=w, minlength=n).astype(np.int64)

    tokens = per_trajectory(keep, count)
    generated_tokens = per_trajectory(keep & generated, count)
    interruptions = per_trajectory(keep & generated & aborted)
    prev_generated = np.r_[False, generated[:-1]] & same
    turns = per_trajectory(keep & generated & ~prev_generated)  # replies: a generated run starts each

    chosen = keep & generated & (count > 0)
    oldest, newest, pairs, by_version = _versions(store, owner[chosen], field("token_start")[chosen], count[chosen], n)
    del chosen, same, keep, generated, aborted
    assembled = {int(row): store.get(_text(records["id"][row])) for row in np.flatnonzero(forked)}
    for row, trajectory in assembled.items():  # the few forked ones: by the definition
        written = trajectory.token_versions()
        written = written[written != NO_VERSION]
        if len(written):
            oldest[row], newest[row] = written.min(), written.max()
            pairs.append(row << 32 | np.unique(written).astype(np.int64))
            by_version.append(np.bincount(written))
    keys = np.sort(np.concatenate(pairs)) if pairs else np.zeros(0, np.int64)  # row << 32 | version
    keys = keys[np.r_[True, keys[1:] != keys[:-1]]] if len(keys) else keys  # each pair once
    pairs_array = np.stack([keys >> 32, keys & 0xFFFFFFFF], 1)
    versions = np.bincount(pairs_array[:, 0], minlength=n).astype(np.int64)
    total = np.zeros(max((len(b) for b in by_version), default=0), np.int64)
    for part in by_version:
        total[:len(part)] += part.astype(np.int64)
    tokens_by_version = {int(v): int(c) for v, c in enumerate(total) if c}

    # Status: the latest record of each trajectory (none yet: running).
    statuses = store.table("statuses")
    latest = store.latest_status_rows()
    has = latest >= 0
    current = statuses[latest[has]]
    status_code = np.full(n, Status.RUNNING.code, np.int64)
    status_code[has] = current["status"]
    reward = np.full(n, np.nan)
    reward[has] = current["reward"]
    created = records["created"].astype(np.float64)
    updated = created.copy()
    updated[has] = current["time"]
    fail_reason = _fail_reasons(store, status_code, latest, statuses)

    # Consumption: the trajectory's last mark, as `trajectory_rows` reads them.
    marks = store.table("marks")
    last_mark = np.full(n, -1, np.int64)
    np.maximum.at(last_mark, marks["trajectory"], np.arange(len(marks), dtype=np.int64))
    marked = last_mark >= 0
    step = np.full(n, -1, np.int64)
    trained = np.full(n, -1, np.int64)
    step[marked] = marks["step"][last_mark[marked]]
    trained[marked] = marks["policy_version"][last_mark[marked]]
    has_versions = oldest >= 0
    staleness = np.where(marked & has_versions, trained - oldest, -1)

    columns: dict[str, np.ndarray | list] = {
        "id": store.ids(), "task": _texts(records["task"]),
        "group": _texts(records["group"]), **_agents_and_episodes(store, records),
        "status": STATUS_NAMES[status_code], "reward": reward, "turns": turns, "tokens": tokens,
        "generated_tokens": generated_tokens, "min_version": oldest, "max_version": newest,
        "consumed_step": step, "trained_version": trained, "staleness": staleness, "created": created,
        "updated": updated, "fail_reason": fail_reason, "versions": versions,
        "interruptions": interruptions,
    }
    for row, trajectory in assembled.items():
        mark = None if not marked[row] else _mark(marks[last_mark[row]], records)
        exact = trajectory_row(trajectory, mark)
        for name in ("tokens", "generated_tokens", "turns", "interruptions"):
            columns[name][row] = exact[name]  # type: ignore[index]
    return StoreColumns(columns, pairs_array, tokens_by_version)


def columns_frame(columns: dict[str, np.ndarray | list], dtypes: dict[str, str]) -> pd.DataFrame:
    """The columns as typed pandas columns: -1 (a version, a step) and NaN (a reward) become <NA>."""
    data = {}
    for name, dtype in dtypes.items():
        values = columns[name]
        if dtype == "Int64":
            values = np.asarray(values)
            data[name] = pd.arrays.IntegerArray(values.astype(np.int64), values < 0)
        elif dtype == "Float64":
            values = np.asarray(values, np.float64)
            data[name] = pd.arrays.FloatingArray(values, np.isnan(values))
        else:
            data[name] = pd.array(values, dtype=dtype) if dtype == "string" else np.asarray(values).astype(dtype)
    return pd.DataFrame(data)


def _versions(store: StoreView, owners: np.ndarray, starts: np.ndarray, counts: np.ndarray,
              n: int) -> tuple[np.ndarray, np.ndarray, list, list]:
    """Oldest and newest version per trajectory (-1: none), (row << 32 | version) keys and tokens per version,
    from generated segments (of chain trajectories, non-empty) and the token versions under them."""
    oldest = np.full(n, -1, np.int64)
    newest = np.full(n, -1, np.int64)
    if not len(owners):
        return oldest, newest, [], []
    by_start = np.argsort(starts, kind="stable")
    owners, starts, counts = owners[by_start], starts[by_start], counts[by_start]
    ends = starts + counts
    seg_min = np.empty(len(starts), np.int64)
    seg_max = np.empty(len(starts), np.int64)
    multi: list[np.ndarray] = []  # tokens of segments that span a weight update
    # A slice of segments at a time: the versions under them are read in one go, not the whole column.
    for a in range(0, len(starts), SEGMENTS_PER_READ):
        b = min(len(starts), a + SEGMENTS_PER_READ)
        low, high = int(starts[a]), int(ends[a:b].max())
        written = store.data("tokens/versions", low, high)
        # reduceat over [start, end) pairs: the even results are each segment's own span (the odd ones, the
        # gaps between segments, are dropped). A last end at the slice's end is implied.
        edges = np.stack([starts[a:b] - low, ends[a:b] - low], 1).ravel()
        if edges[-1] >= len(written):
            edges = edges[:-1]
        seg_min[a:b] = np.minimum.reduceat(written, edges)[::2]
        seg_max[a:b] = np.maximum.reduceat(written, edges)[::2]
        for i in np.flatnonzero(seg_min[a:b] != seg_max[a:b]):
            multi.append(written[starts[a + i] - low:ends[a + i] - low].astype(np.int64))
    low_v = np.full(n, np.iinfo(np.int64).max)
    np.minimum.at(low_v, owners, seg_min)
    np.maximum.at(newest, owners, seg_max)
    oldest = np.where(newest >= 0, low_v, -1)
    one = seg_min == seg_max  # a segment of one version (every generation that no weight update split)
    pairs = [owners[one].astype(np.int64) << 32 | seg_min[one]]
    by_version = [np.bincount(seg_min[one], weights=counts[one].astype(np.float64))]
    for i, values in zip(np.flatnonzero(~one), multi):
        pairs.append(int(owners[i]) << 32 | np.unique(values))
        by_version.append(np.bincount(values))
    return oldest, newest, pairs, by_version


def _fail_reasons(store: StoreView, status_code: np.ndarray, latest: np.ndarray, statuses: np.ndarray) -> list:
    """Why each failed trajectory failed ("" for the others); a failed record points into the metadata blob."""
    reasons = [""] * len(status_code)
    failed = np.flatnonzero(status_code == FAILED)
    if not len(failed):
        return reasons
    recs = statuses[latest[failed]]
    low = int(recs["rewards_start"].min())
    blob = store.data("blobs/metadata", low, int((recs["rewards_start"] + recs["rewards_count"]).max())).tobytes()
    for row, start, count in zip(failed, recs["rewards_start"] - low, recs["rewards_count"]):
        reasons[row] = blob[start:start + count].decode("utf-8")
    return reasons


def _mark(mark: np.void, records: np.ndarray) -> ConsumptionMark:
    return ConsumptionMark(int(mark["step"]), _text(records["id"][mark["trajectory"]]), int(mark["policy_version"]),
                           float(mark["time"]))


def _text(value: bytes) -> str:
    return value.decode("utf-8")


def _agents_and_episodes(store: StoreView, records: np.ndarray) -> dict[str, list[str]]:
    """Each trajectory's agent ("" for none) and episode (its own id unless its metadata names one), read
    from the metadata blob at once (one range: trajectories' metadata are recorded in start order)."""
    ids = store.ids()
    agents, episodes = [""] * len(ids), list(ids)
    rows = np.flatnonzero(records["meta_count"] > 0)
    if not len(rows):
        return {"agent": agents, "episode": episodes}
    starts, counts = records["meta_start"][rows].astype(np.int64), records["meta_count"][rows].astype(np.int64)
    low = int(starts.min())
    blob = store.data("blobs/metadata", low, int((starts + counts).max())).tobytes()
    for row, start, count in zip(rows.tolist(), (starts - low).tolist(), counts.tolist()):
        meta = blob[start:start + count].decode("utf-8")
        agents[row] = agent_of(meta) or ""
        episodes[row] = episode_of(ids[row], meta)
    return {"agent": agents, "episode": episodes}


def _texts(values: np.ndarray) -> list[str]:
    """Fixed-width UTF-8 fields that repeat (tasks, groups) as Python strings, each distinct one decoded once.
    (A trajectory without a group has "" here, as `trajectory_row` gives it.)"""
    decoded: dict[bytes, str] = {}
    return [decoded.get(v) or decoded.setdefault(v, v.decode("utf-8")) for v in values.tolist()]
