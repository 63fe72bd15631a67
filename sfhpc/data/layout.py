"""The on-disk layout of a trajectory store (schema version 2; version 1 files are still read).

Everything is a one-dimensional, chunked, unlimited dataset of fixed-size elements, because SWMR readers
cannot follow variable-length data and a SWMR writer cannot create objects. Ragged data (tokens, JSON
metadata, per-turn rewards) lives in flat arrays that fixed-size table rows point into by (start, count).

    /tokens/ids        int32    every recorded token, segment after segment, in the order they arrived
    /tokens/logprobs   float32  aligned with ids (0.0 for tokens the policy did not generate)
    /tokens/versions   int32    aligned with ids (-1 for tokens the policy did not generate)
    /blobs/metadata    uint8    JSON metadata of trajectories, and the reasons of failed ones (UTF-8)
    /blobs/rewards     float64  per-turn rewards
    /trajectories      table    one row per trajectory: id, task, group, created, metadata (start, count)
    /segments          table    one row per segment: trajectory row, index, parent, fork, kind, tokens ...
    /statuses          table    status changes, appended; the latest record of a trajectory is its status
    /marks             table    consumption marks: training step -> trajectory row
    /timeline          table    one row per state interval of a rank: rank, role, state, start, end, step
    /blobs/scores      float32  per-token scores of trained trajectories (the distillation teacher's logprobs)
    /scores            table    one row per scored trajectory: step, trajectory row, scorer, values (start, count)
    /commits           table    one row per flush: how many elements of every dataset above are complete

A flush writes the data arrays, then the tables that point into them, then a commit row. Readers (and a
writer that reopens after a crash) trust only what the last commit row counts, so a writer killed in the
middle of a flush leaves at most an uncommitted tail, never a row that points at missing data.

Schema history. Version 3 added ``/blobs/scores`` and ``/scores`` (a store written before has no scores, and
a writer that reopens it records none). Version 2 added the sampling of each generated segment
(``temperature``, ``top_p``; NaN: unknown) and the ``/timeline`` table. A version 1 file has neither: readers
see its segments with unknown sampling and an empty timeline, and a writer that reopens one keeps writing
version 1 rows (an HDF5 dataset's type is fixed and SWMR cannot add datasets), so a run resumed on an old store
records no timeline.
"""

from __future__ import annotations

import numpy as np

from sfhpc.data.errors import InvalidRequest

SCHEMA_VERSION = 3
SCHEMA_ATTR = "sfhpc_schema"  # file attribute: the layout version; readers refuse newer ones
KIND_ATTR = "sfhpc_kind"
KIND = "trajectory-store"
CREATED_ATTR = "created"
RUN_ATTR = "run_metadata"  # file attribute: JSON given when the store was created

ID_BYTES = 128  # fixed-width string fields (UTF-8); longer values are refused, never cut
TASK_BYTES = 64
GROUP_BYTES = 128
ENGINE_BYTES = 64
REASON_BYTES = 32
ROLE_BYTES = 32  # a rank's roles, comma-joined ("trainer", "rollout", "trainer,rollout")
STATE_BYTES = 16
SCORER_BYTES = 32

TRAJECTORY_DTYPE = np.dtype([
    ("id", f"S{ID_BYTES}"),
    ("task", f"S{TASK_BYTES}"),
    ("group", f"S{GROUP_BYTES}"),
    ("has_group", "u1"),  # group "" and no group are different things
    ("created", "f8"),
    ("meta_start", "i8"),
    ("meta_count", "i8"),
])

_SEGMENT_V1_FIELDS = [
    ("trajectory", "i8"),  # row in /trajectories
    ("index", "i4"),  # position in the trajectory's segment list
    ("parent", "i4"),
    ("fork_at", "i8"),
    ("kind", "u1"),
    ("token_start", "i8"),  # into /tokens/*
    ("token_count", "i8"),
    ("engine", f"S{ENGINE_BYTES}"),
    ("t_start", "f8"),
    ("t_end", "f8"),
    ("finish_reason", f"S{REASON_BYTES}"),
]
SEGMENT_DTYPE_V1 = np.dtype(_SEGMENT_V1_FIELDS)
SEGMENT_DTYPE = np.dtype(_SEGMENT_V1_FIELDS + [
    ("temperature", "f8"),  # the sampling of generated tokens; NaN: unknown (and for other kinds). f8, not f4:
    # a value reads back exactly as it was given (0.7, not 0.699999988), so a trainer compares it as it is
    ("top_p", "f8"),
])

STATUS_DTYPE = np.dtype([
    ("trajectory", "i8"),
    ("status", "u1"),
    ("time", "f8"),
    ("reward", "f8"),  # NaN: none
    # Per-turn rewards, into /blobs/rewards. A FAILED record has no rewards: these point at its reason
    # instead (UTF-8, into /blobs/metadata), which keeps the schema (a new dataset would need a new one).
    ("rewards_start", "i8"),
    ("rewards_count", "i8"),
])

MARK_DTYPE = np.dtype([
    ("step", "i8"),
    ("trajectory", "i8"),
    ("policy_version", "i8"),
    ("time", "f8"),
])

TIMELINE_DTYPE = np.dtype([
    ("rank", "i4"),
    ("role", f"S{ROLE_BYTES}"),
    ("state", f"S{STATE_BYTES}"),  # generating, training, syncing, lent, waiting
    ("t_start", "f8"),  # wall-clock seconds (time.time()), or the clock the scheduler was given
    ("t_end", "f8"),
    ("step", "i8"),  # the training step the run was working towards when the interval began
])

SCORE_DTYPE = np.dtype([
    ("step", "i8"),  # the training step that trained on the trajectory
    ("trajectory", "i8"),  # row in /trajectories
    ("scorer", f"S{SCORER_BYTES}"),  # who scored it ("teacher")
    ("start", "i8"),  # into /blobs/scores: one value per token of the trajectory's trained branch
    ("count", "i8"),
])

# The growing datasets, in the order a flush writes them: data first, the rows that point into it after.
DATA_V2: dict[str, np.dtype] = {
    "tokens/ids": np.dtype("i4"),
    "tokens/logprobs": np.dtype("f4"),
    "tokens/versions": np.dtype("i4"),
    "blobs/metadata": np.dtype("u1"),
    "blobs/rewards": np.dtype("f8"),
}
DATA: dict[str, np.dtype] = {**DATA_V2, "blobs/scores": np.dtype("f4")}
TABLES_V2: dict[str, np.dtype] = {
    "trajectories": TRAJECTORY_DTYPE,
    "segments": SEGMENT_DTYPE,
    "statuses": STATUS_DTYPE,
    "marks": MARK_DTYPE,
    "timeline": TIMELINE_DTYPE,
}
TABLES: dict[str, np.dtype] = {**TABLES_V2, "scores": SCORE_DTYPE}
GROWING = {**DATA, **TABLES}
COMMITS = "commits"


def _commit_dtype(growing: dict[str, np.dtype]) -> np.dtype:
    # One commit row: the time, the writer session (1 for the run's first process, +1 per reopen) and the
    # committed length of every growing dataset. Column names are the dataset paths with '/' -> '.'.
    return np.dtype([("time", "f8"), ("session", "i8")] + [(name.replace("/", "."), "i8") for name in growing])


COMMIT_DTYPE = _commit_dtype(GROWING)


class Schema:
    """The datasets of one schema version and their types (what a reader checks, what a writer writes)."""

    def __init__(self, version: int, data: dict[str, np.dtype], tables: dict[str, np.dtype]) -> None:
        self.version = version
        self.data, self.tables = data, tables
        self.growing = {**data, **tables}
        self.commit_dtype = _commit_dtype(self.growing)

    @property
    def datasets(self) -> dict[str, np.dtype]:
        """Every dataset of the file, the commit table included."""
        return {**self.growing, COMMITS: self.commit_dtype}

    def has(self, table: str) -> bool:
        return table in self.tables


_SCHEMAS = {
    1: Schema(1, DATA_V2, {**{k: v for k, v in TABLES_V2.items() if k != "timeline"}, "segments": SEGMENT_DTYPE_V1}),
    2: Schema(2, DATA_V2, TABLES_V2),
    SCHEMA_VERSION: Schema(SCHEMA_VERSION, DATA, TABLES),
}


def schema(version: int) -> Schema:
    """The layout of `version` (1 up to SCHEMA_VERSION); KeyError for a version this sfhpc does not know."""
    return _SCHEMAS[version]


def upgraded(name: str, rows: np.ndarray) -> np.ndarray:
    """Rows of table `name` from an older schema, in the current row type: fields the old schema lacks are
    NaN (floats) or zero. Rows already of the current type come back as they are."""
    dtype = TABLES[name]
    if rows.dtype == dtype:
        return rows
    out = np.zeros(len(rows), dtype)
    assert dtype.names is not None and rows.dtype.names is not None  # table rows are structured
    for field in dtype.names:
        if field in rows.dtype.names:
            out[field] = rows[field]
        elif dtype[field].kind == "f":
            out[field] = np.nan
    return out

CHUNK_ELEMENTS = {"tokens/ids": 1 << 16, "tokens/logprobs": 1 << 16, "tokens/versions": 1 << 16,
                  "blobs/metadata": 1 << 16, "blobs/rewards": 4096, "blobs/scores": 1 << 16, COMMITS: 1024}
DEFAULT_TABLE_CHUNK = 2048


def chunk_of(name: str) -> int:
    return CHUNK_ELEMENTS.get(name, DEFAULT_TABLE_CHUNK)


def encode_fixed(value: str, size: int, what: str) -> bytes:
    """`value` as UTF-8 for a fixed-width field of `size` bytes; InvalidRequest when it does not fit (a value
    is refused, never cut)."""
    data = value.encode("utf-8")
    if len(data) > size:
        raise InvalidRequest(f"{what} {value[:40]!r}... is {len(data)} bytes long; the store holds at most {size}")
    return data


def decode_text(value: bytes) -> str:
    """A fixed-width field's text (HDF5 strips the padding)."""
    return value.decode("utf-8")
