"""The on-disk layout of a trajectory store (schema version 1).

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
    /commits           table    one row per flush: how many elements of every dataset above are complete

A flush writes the data arrays, then the tables that point into them, then a commit row. Readers (and a
writer that reopens after a crash) trust only what the last commit row counts, so a writer killed in the
middle of a flush leaves at most an uncommitted tail, never a row that points at missing data.
"""

from __future__ import annotations

import numpy as np

SCHEMA_VERSION = 1
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

TRAJECTORY_DTYPE = np.dtype([
    ("id", f"S{ID_BYTES}"),
    ("task", f"S{TASK_BYTES}"),
    ("group", f"S{GROUP_BYTES}"),
    ("has_group", "u1"),  # group "" and no group are different things
    ("created", "f8"),
    ("meta_start", "i8"),
    ("meta_count", "i8"),
])

SEGMENT_DTYPE = np.dtype([
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

# The growing datasets, in the order a flush writes them: data first, the rows that point into it after.
DATA = {
    "tokens/ids": np.dtype("i4"),
    "tokens/logprobs": np.dtype("f4"),
    "tokens/versions": np.dtype("i4"),
    "blobs/metadata": np.dtype("u1"),
    "blobs/rewards": np.dtype("f8"),
}
TABLES = {
    "trajectories": TRAJECTORY_DTYPE,
    "segments": SEGMENT_DTYPE,
    "statuses": STATUS_DTYPE,
    "marks": MARK_DTYPE,
}
GROWING = {**DATA, **TABLES}

# One commit row: the time, the writer session (1 for the run's first process, +1 per reopen) and the
# committed length of every growing dataset. Column names are the dataset paths with '/' -> '.'.
COMMIT_DTYPE = np.dtype([("time", "f8"), ("session", "i8")]
                        + [(name.replace("/", "."), "i8") for name in GROWING])
COMMITS = "commits"

CHUNK_ELEMENTS = {"tokens/ids": 1 << 16, "tokens/logprobs": 1 << 16, "tokens/versions": 1 << 16,
                  "blobs/metadata": 1 << 16, "blobs/rewards": 4096, COMMITS: 1024}
DEFAULT_TABLE_CHUNK = 2048


def chunk_of(name: str) -> int:
    return CHUNK_ELEMENTS.get(name, DEFAULT_TABLE_CHUNK)
