"""One row per trajectory of a store, for a spreadsheet or a data frame (``sfhpc traj export``).

    from sfhpc.analysis import locate_store, trajectory_rows
    from sfhpc.data import open_store

    with open_store(locate_store("runs/demo-20261129-132650")) as store:
        rows = list(trajectory_rows(store))     # dicts with the TRAJECTORY_COLUMNS keys
    # pandas.DataFrame(rows), if pandas is at hand

Columns: the record's id, task, GRPO group, agent and episode (in an episode of several agents, the agent
whose conversation it is and the episode its agents share; else empty and the trajectory's own id), status
and reward; its number of turns (the policy's replies
along the current branch, as `sfhpc traj show` numbers them: `Trajectory.reply_spans`); tokens on its
current branch and how many the policy generated; the oldest and newest policy version among those
tokens; the training step that consumed it and the trainer's version then (empty if none did), hence the
staleness it was trained at; creation and last-change times (Unix s); why it failed (status failed; empty
otherwise). The data frames (`sfhpc.analysis.open_run`) add how many
policy versions wrote it and its interruptions (generations cut by a weight update or a restart and
continued).
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from sfhpc.data.store import ConsumptionMark, StoreView
from sfhpc.data.trajectory import Trajectory, episode_of
from sfhpc.errors import SfhpcError
from sfhpc.rundir import RunPaths

TRAJECTORY_COLUMNS = ("id", "task", "group", "agent", "episode", "status", "reward", "turns", "tokens",
                      "generated_tokens", "min_version", "max_version", "consumed_step", "trained_version", "staleness",
                      "created", "updated", "fail_reason")
EXTRA_COLUMNS = ("versions", "interruptions")  # in the data frames and Parquet/JSONL, not the CSV


def locate_store(path: str | Path) -> Path:
    """The store file named by `path`: the file itself, or a run folder holding ``trajectories.h5``."""
    path = Path(path)
    if path.is_dir():
        path = RunPaths(path).store
        if not path.exists():
            raise SfhpcError(f"{path.parent}: no {path.name} in this folder; pass a run folder or a store file")
    elif not path.exists():
        raise SfhpcError(f"{path}: no such file or folder; pass a run folder or its {RunPaths(path).store.name}")
    return path


def trajectory_rows(store: StoreView) -> Iterator[dict[str, Any]]:
    """One dict per trajectory, in the order they were started (`trajectory_row`'s keys)."""
    consumed = {mark.trajectory_id: mark for mark in store.marks()}
    for trajectory in store.trajectories():
        yield trajectory_row(trajectory, consumed.get(trajectory.id))


def trajectory_row(trajectory: Trajectory, mark: ConsumptionMark | None) -> dict[str, Any]:
    """The TRAJECTORY_COLUMNS of one trajectory (given the step that consumed it, if any), then the
    EXTRA_COLUMNS: distinct policy versions, interruptions."""
    versions = trajectory.token_versions()[trajectory.generated_mask()]
    newest = int(versions.max()) if len(versions) else None
    # A generation cut by a weight update or a restart ends with "abort"; another segment continues it.
    interruptions = sum(1 for i, _ in trajectory.branch()
                        if trajectory.segments[i].generated and trajectory.segments[i].finish_reason == "abort")
    return {
        "id": trajectory.id, "task": trajectory.task, "group": trajectory.group or "",
        "agent": trajectory.agent or "", "episode": episode_of(trajectory.id, trajectory.metadata_json),
        "status": str(trajectory.status.value), "reward": trajectory.reward,
        # A turn is a reply of the policy, whether or not the agent reported a reward for it (an agent
        # program reports none per turn).
        "turns": len(trajectory.reply_spans()), "tokens": trajectory.num_tokens,
        "generated_tokens": trajectory.num_generated,
        "min_version": int(versions.min()) if len(versions) else None, "max_version": newest,
        "consumed_step": mark.step if mark else None, "trained_version": mark.policy_version if mark else None,
        # How many versions behind the trainer its oldest token was when it was trained on.
        "staleness": mark.policy_version - int(versions.min()) if mark and len(versions) else None,
        "created": trajectory.created, "updated": trajectory.updated, "fail_reason": trajectory.fail_reason,
        "versions": len(np.unique(versions)), "interruptions": interruptions,
    }


def write_csv(rows: Iterable[dict[str, Any]], out: Path) -> int:
    """Write `rows` as CSV with a header (empty cells for missing values); returns the number of rows."""
    count = 0
    with out.open("x", newline="", encoding="utf-8") as handle:  # "x": never overwrite a user's file
        writer = csv.DictWriter(handle, fieldnames=TRAJECTORY_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
            count += 1
    return count
