"""A run's trajectories as pandas data frames, for the people who study the policy.

    from sfhpc.analysis import open_run

    with open_run("runs/demo-20261129-132650") as run:      # a run folder, or its trajectories.h5
        df = run.trajectories(steps=(100, 200), status="consumed", max_reward=0.0)
        turns, segments, steps = run.turns(), run.segments(), run.steps()
        print(run.decode(run.trajectory(df.id[0]).context()))

Everything is read through the store's own reader (`sfhpc.data.open_store`), which is SWMR: a run that
is still writing can be read, and `refresh()` catches up with what it committed since. The frames are
built in one pass over the store and kept until a refresh brings something new.

Frames (columns typed; missing values are <NA>):

- `trajectories()`: one row per trajectory, `trajectory_row`'s columns (TRAJECTORY_COLUMNS + EXTRA_COLUMNS).
- `turns()`: one row per policy reply along the current branch: the segments a weight update or a restart
  split it into count as one reply, its versions are every version that wrote it.
- `segments()`: one row per recorded segment, every branch; `used` is how many of its tokens the current
  branch uses (0: off the branch).
- `timeline()`: one row per state interval of a rank (the run's timeline; empty for a store that has
  none): rank, role, state (generating, training, syncing, lent, waiting), t_start, t_end (Unix s), seconds,
  step; `bubble()` sums it up (waiting rank-seconds / all, per role; None when the store keeps no timeline).
- `steps()`: one row per training step, from the store's consumption marks (`policy_version`: the
  trainer's version when it took the batch), joined with the run folder's ``metrics.jsonl`` when there is
  one (its `version` is the version the step produced; its columns that clash with the store's get a
  ``metrics_`` prefix). A step number a restart trained again counts the trajectories of both tries.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sfhpc.analysis.columns import columns_frame, store_columns
from sfhpc.analysis.trajectories import EXTRA_COLUMNS, TRAJECTORY_COLUMNS, locate_store
from sfhpc.data import open_store
from sfhpc.data.rank_intervals import BubbleFraction
from sfhpc.data.run_log import read_log
from sfhpc.data.store import ConsumptionMark, StoreReader
from sfhpc.data.trajectory import NO_VERSION, Trajectory
from sfhpc.engine.tokenizer import run_tokenizer
from sfhpc.rundir import RunPaths

# Column -> dtype. Nullable types (Int64, Float64, string) so that "none" stays <NA> and survives Parquet.
STR, INT, OPT_INT, FLOAT, OPT_FLOAT, BOOL = "string", "int64", "Int64", "float64", "Float64", "bool"
TRAJECTORY_DTYPES: dict[str, str] = {
    "id": STR, "task": STR, "group": STR, "agent": STR, "episode": STR, "status": STR, "reward": OPT_FLOAT,
    "turns": INT, "tokens": INT,
    "generated_tokens": INT, "min_version": OPT_INT, "max_version": OPT_INT, "consumed_step": OPT_INT,
    "trained_version": OPT_INT, "staleness": OPT_INT, "created": FLOAT, "updated": FLOAT, "fail_reason": STR,
    "versions": INT, "interruptions": INT,
}
assert tuple(TRAJECTORY_DTYPES) == TRAJECTORY_COLUMNS + EXTRA_COLUMNS
TURN_DTYPES: dict[str, str] = {
    "trajectory": STR, "turn": INT, "tokens": INT, "segments": INT, "min_version": OPT_INT,
    "max_version": OPT_INT, "versions": INT, "interruptions": INT, "finish_reason": STR, "engines": STR,
    "turn_reward": OPT_FLOAT, "t_start": FLOAT, "t_end": FLOAT,
}
SEGMENT_DTYPES: dict[str, str] = {
    "trajectory": STR, "index": INT, "kind": STR, "parent": INT, "fork_at": INT, "tokens": INT, "used": INT,
    "min_version": OPT_INT, "max_version": OPT_INT, "versions": INT, "engine": STR, "t_start": FLOAT,
    "t_end": FLOAT, "finish_reason": STR, "temperature": OPT_FLOAT, "top_p": OPT_FLOAT,
}
TIMELINE_DTYPES: dict[str, str] = {
    "rank": INT, "role": STR, "state": STR, "t_start": FLOAT, "t_end": FLOAT, "seconds": FLOAT, "step": INT,
}
STEP_DTYPES: dict[str, str] = {
    "step": INT, "policy_version": INT, "trajectories": INT, "reward_mean": OPT_FLOAT, "tokens": INT,
    "generated_tokens": INT, "mean_staleness": OPT_FLOAT, "max_staleness": OPT_INT, "time": FLOAT,
}

Range = int | tuple[int | None, int | None]  # one value, or an inclusive (low, high), either end open


def frame(rows: Sequence[dict[str, Any]], dtypes: dict[str, str]) -> pd.DataFrame:
    """A data frame with exactly these columns and types; an empty one when there are no rows."""
    return pd.DataFrame({name: pd.Series([row[name] for row in rows], dtype=dtype)
                         for name, dtype in dtypes.items()})


class Run:
    """A run's store (and metrics), read-only. Build with `open_run`; close it (or use `with`)."""

    def __init__(self, store: StoreReader, folder: Path | None,
                 progress: Callable[[int, int], None] | None = None) -> None:
        self.store, self.folder, self._progress = store, folder, progress
        self._tokenizer = run_tokenizer(store.run_metadata, folder)  # the vocabulary of the run's model
        self._frames: dict[str, pd.DataFrame] | None = None
        self._version_pairs = np.zeros((0, 2), np.int64)  # (trajectory row, version) pairs, unique
        self._tokens_by_version: dict[int, int] = {}

    @property
    def path(self) -> Path:
        return self.store.path

    @property
    def schema(self) -> int:
        return self.store.schema

    # -- text ------------------------------------------------------------------------------------------

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids in the run's vocabulary, markers (``<|user|>``) written out: what the model saw."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special=False)

    def token_text(self, token_id: int) -> str:
        """One token on its own, for per-token listings (a byte inside a character is shown as its code)."""
        try:
            return self._tokenizer.token_text(int(token_id))
        except ValueError:
            return f"<|{int(token_id)}|>"  # outside the vocabulary: shown, not refused (a reader's tool)

    # -- records ---------------------------------------------------------------------------------------

    def trajectory(self, trajectory_id: str) -> Trajectory:
        """One trajectory as last committed; unknown ids raise `UnknownTrajectory` (a one-line error)."""
        return self.store.get(trajectory_id)

    def consumed_by(self, trajectory_id: str) -> ConsumptionMark | None:
        """The training step that consumed this trajectory (its mark), or None."""
        return next((m for m in self.store.marks() if m.trajectory_id == trajectory_id), None)

    def refresh(self) -> bool:
        """Catch up with a run that is still writing; True (and the frames rebuilt on demand) when new."""
        changed = self.store.refresh()
        if changed:
            self._frames = None
        return changed

    # -- frames ----------------------------------------------------------------------------------------

    def trajectories(self, *, steps: Range | None = None, status: str | Iterable[str] | None = None,
                     min_reward: float | None = None, max_reward: float | None = None,
                     version: int | None = None, staleness: Range | None = None) -> pd.DataFrame:
        """One row per trajectory, in start order, optionally filtered (all filters must hold):
        `steps`: trained at a step in that range; `status`: one status or several; `min_reward` /
        `max_reward`: rewarded within them (inclusive); `version`: some token of it was generated by that
        policy version; `staleness`: trained at a staleness in that range."""
        df = self._frame("trajectories")
        keep = pd.Series(True, index=df.index)
        if steps is not None:
            keep &= _in_range(df["consumed_step"], steps)
        if status is not None:
            keep &= df["status"].isin([status] if isinstance(status, str) else list(status))
        if min_reward is not None:
            keep &= (df["reward"] >= min_reward).fillna(False)
        if max_reward is not None:
            keep &= (df["reward"] <= max_reward).fillna(False)
        if version is not None:
            written = np.zeros(len(df), bool)
            written[self._version_pairs[self._version_pairs[:, 1] == version, 0]] = True
            keep &= written
        if staleness is not None:
            keep &= _in_range(df["staleness"], staleness)
        return df[keep.astype(bool)].reset_index(drop=True)

    def turns(self) -> pd.DataFrame:
        return self._frame("turns")

    def segments(self) -> pd.DataFrame:
        return self._frame("segments")

    def steps(self) -> pd.DataFrame:
        return self._frame("steps")

    def timeline(self) -> pd.DataFrame:
        return self._frame("timeline")

    def bubble(self) -> BubbleFraction | None:
        """The bubble fraction of the run's timeline; None when the store keeps none (schema 1)."""
        return self.store.bubble() if self.store.records_timeline else None

    def _frame(self, name: str) -> pd.DataFrame:
        if self._frames is None:
            self._frames = {}
        if name not in self._frames:
            if name in ("turns", "segments"):
                self._frames.update(self._collect_replies())
            elif name == "timeline":
                self._frames["timeline"] = _timeline_frame(self.store.table("timeline"))
            elif name == "trajectories":
                columns = store_columns(self.store)
                self._frames["trajectories"] = columns_frame(columns.columns, TRAJECTORY_DTYPES)
                self._version_pairs, self._tokens_by_version = columns.version_pairs, columns.tokens_by_version
            else:
                self._frames["steps"] = self._steps(self._frame("trajectories"))
        return self._frames[name].copy()  # a copy: a caller's edits never leak into the next call

    def tokens_by_version(self) -> dict[int, int]:
        """Generated tokens on the current branches of every trajectory, per policy version that wrote them."""
        self._frame("trajectories")
        return dict(self._tokens_by_version)

    def _collect_replies(self) -> dict[str, pd.DataFrame]:
        """The turn and segment frames, in one pass over the store (each trajectory is assembled once)."""
        turns: list[dict[str, Any]] = []
        segments: list[dict[str, Any]] = []
        total = len(self.store)
        for n, trajectory in enumerate(self.store.trajectories(), start=1):
            turns.extend(_turn_rows(trajectory))
            segments.extend(_segment_rows(trajectory))
            if self._progress is not None:
                self._progress(n, total)
        return {"turns": frame(turns, TURN_DTYPES), "segments": frame(segments, SEGMENT_DTYPES)}

    def _steps(self, trajectories: pd.DataFrame) -> pd.DataFrame:
        trained = trajectories[trajectories["consumed_step"].notna()]
        marks = self.store.table("marks")
        mark_time = pd.Series(marks["time"]).groupby(marks["step"]).max()
        by_step = trained.groupby(trained["consumed_step"].astype("int64"), sort=True)
        steps = pd.DataFrame({
            "step": np.asarray(list(by_step.groups), dtype=np.int64) if len(trained) else np.zeros(0, np.int64),
        })
        if len(trained):
            steps["policy_version"] = by_step["trained_version"].max().to_numpy(np.int64)
            steps["trajectories"] = by_step.size().to_numpy(np.int64)
            steps["reward_mean"] = by_step["reward"].mean().astype(OPT_FLOAT).to_numpy()
            steps["tokens"] = by_step["tokens"].sum().to_numpy(np.int64)
            steps["generated_tokens"] = by_step["generated_tokens"].sum().to_numpy(np.int64)
            steps["mean_staleness"] = by_step["staleness"].mean().astype(OPT_FLOAT).to_numpy()
            steps["max_staleness"] = by_step["staleness"].max().astype(OPT_INT).to_numpy()
            steps["time"] = mark_time.reindex(steps["step"]).to_numpy(np.float64)
        steps = pd.DataFrame({name: pd.Series(steps.get(name, []), dtype=dtype)
                              for name, dtype in STEP_DTYPES.items()})
        metrics = self._metrics()
        if metrics is None:
            return steps
        metrics = metrics.rename(columns={c: f"metrics_{c}" for c in metrics.columns if c in STEP_DTYPES
                                          and c != "step"})
        # Outer: a step the store has no marks for (or metrics lack) still shows, with <NA> where unknown.
        merged = steps.merge(metrics, on="step", how="outer", sort=True)
        for name, dtype in STEP_DTYPES.items():  # the store's columns keep their types; <NA> where unknown
            missing = bool(merged[name].isna().any())
            merged[name] = merged[name].astype(OPT_INT if missing and dtype == INT else dtype)
        return merged

    def _metrics(self) -> pd.DataFrame | None:
        """The run's ``metrics.jsonl`` (one JSON object per trained step), or None without one."""
        path = None if self.folder is None else RunPaths(self.folder).metrics
        if path is None or not path.is_file():
            return None
        records = [record for record in read_log(path) if "step" in record]
        if not records:
            return None
        metrics = pd.DataFrame.from_records(records)
        metrics["step"] = metrics["step"].astype("int64")
        return metrics

    # -- lifetime --------------------------------------------------------------------------------------

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_run(path: str | Path, *, progress: Callable[[int, int], None] | None = None) -> Run:
    """Open a run folder (or its ``trajectories.h5``) for reading; the run may still be writing it.
    `progress(done, total)` is called per trajectory while the frames are built (large stores are slow)."""
    store_path = locate_store(path)
    store = open_store(store_path)
    return Run(store, store_path.parent, progress)


def _versions_of(values: np.ndarray) -> tuple[int | None, int | None, int]:
    """(oldest, newest, how many distinct) policy versions among `values`, ignoring non-generated tokens."""
    present = np.unique(values[values != NO_VERSION])
    if not len(present):
        return None, None, 0
    return int(present[0]), int(present[-1]), len(present)


def _turn_rows(trajectory: Trajectory) -> list[dict[str, Any]]:
    rows = []
    numbers = trajectory.segment_turns()
    for span in trajectory.reply_spans():  # each reply as its agent received it (all it generated that turn)
        turn = numbers[span[-1][0]]
        parts = [trajectory.segments[i] for i, _ in span]
        versions = np.concatenate([seg.versions[:used] for seg, (_, used) in zip(parts, span)])
        oldest, newest, count = _versions_of(versions)
        engines = list(dict.fromkeys(seg.engine for seg in parts if seg.engine))  # in order, once each
        rewards = trajectory.turn_rewards
        rows.append({
            "trajectory": trajectory.id, "turn": turn, "tokens": sum(used for _, used in span),
            "segments": len(span), "min_version": oldest, "max_version": newest, "versions": count,
            "interruptions": sum(seg.finish_reason == "abort" for seg in parts),
            "finish_reason": parts[-1].finish_reason, "engines": ",".join(engines),
            "turn_reward": rewards[turn] if turn < len(rewards) else None,
            "t_start": parts[0].t_start, "t_end": parts[-1].t_end,
        })
    return rows


def _segment_rows(trajectory: Trajectory) -> list[dict[str, Any]]:
    used = dict(trajectory.branch())
    rows = []
    for index, seg in enumerate(trajectory.segments):
        oldest, newest, count = _versions_of(seg.versions)
        rows.append({
            "trajectory": trajectory.id, "index": index, "kind": seg.kind.value, "parent": seg.parent,
            "fork_at": seg.fork_at, "tokens": len(seg), "used": used.get(index, 0), "min_version": oldest,
            "max_version": newest, "versions": count, "engine": seg.engine, "t_start": seg.t_start,
            "t_end": seg.t_end, "finish_reason": seg.finish_reason, "temperature": seg.temperature,
            "top_p": seg.top_p,
        })
    return rows


def _timeline_frame(rows: np.ndarray) -> pd.DataFrame:
    columns = {"rank": rows["rank"], "role": np.char.decode(rows["role"], "utf-8"),
               "state": np.char.decode(rows["state"], "utf-8"), "t_start": rows["t_start"], "t_end": rows["t_end"],
               "seconds": rows["t_end"] - rows["t_start"], "step": rows["step"]}
    return pd.DataFrame({name: pd.Series(columns[name], dtype=dtype) for name, dtype in TIMELINE_DTYPES.items()})


def _in_range(values: pd.Series, spec: Range) -> pd.Series:
    """Where `values` is `spec` (one value) or within `spec` = (low, high), inclusive; <NA> is never in."""
    low, high = (spec, spec) if isinstance(spec, int | np.integer) else spec
    keep = values.notna()
    if low is not None:
        keep &= (values >= low).fillna(False)
    if high is not None:
        keep &= (values <= high).fillna(False)
    return keep.astype(bool)
