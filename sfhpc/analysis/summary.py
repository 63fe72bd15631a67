"""What a run's store holds, in numbers (``sfhpc traj summary``), and the one-line updates of ``--follow``.

Sections: the store (trajectories, tokens, training steps, writer sessions); counts by status; reward and
length per range of training steps; how stale the trained trajectories were; partial rollouts (a
generation cut by a weight update or a restart and continued) and how many policy versions wrote them;
the bubble fraction of the ranks' timeline (waiting rank-seconds / all, per role), or "not recorded".
Everything comes from the run's trajectory frame, which is computed over whole tables (fast on big stores).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sfhpc.analysis.run import Run
from sfhpc.data.rank_intervals import BubbleFraction
from sfhpc.data.run_log import read_log
from sfhpc.data.trajectory import Status
from sfhpc.rundir import RunPaths
from sfhpc.table import format_table

STEP_RANGES = 10  # the step table has at most this many rows, of equal width


@dataclasses.dataclass(frozen=True)
class Summary:
    store: dict[str, Any]
    by_status: dict[str, int]
    step_ranges: list[dict[str, Any]]  # first, last, steps, trajectories, reward_mean, generated_mean, ...
    staleness: dict[int, int]  # versions behind the trainer when trained -> trajectories
    partial: dict[str, Any]  # trajectories, by_versions {how many versions wrote it: trajectories}
    bubble: BubbleFraction | None = None  # None: the store records no timeline (or an empty one)

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["bubble"] = None if self.bubble is None else self.bubble.as_dict()
        return out

    def format(self) -> str:
        s = self.store
        rows = [("path", s["path"]), ("schema", str(s["schema"])), ("writer sessions", str(s["sessions"])),
                ("trajectories", f"{s['trajectories']:,}")]
        rows += [(f"  {status}", f"{n:,}") for status, n in self.by_status.items() if n]
        rows += [("tokens", f"{s['tokens']:,}"), ("generated tokens", f"{s['generated_tokens']:,}"),
                 ("training steps", f"{s['steps']:,}"), ("mean reward", _num(s["mean_reward"], 4))]
        if s["span_s"] is not None:
            rows.append(("span", f"{s['span_s']:.1f} s"))
        rows.append(("bubble fraction", "not recorded" if self.bubble is None else self.bubble.format()))
        parts = [format_table(("store", ""), rows)]
        if self.step_ranges:
            parts.append(format_table(
                ("steps", "trajectories", "mean reward", "generated tokens", "tokens", "mean staleness"),
                [(f"{r['first']}-{r['last']}" if r["first"] != r["last"] else str(r["first"]),
                  f"{r['trajectories']:,}", _num(r["reward_mean"], 4), _num(r["generated_mean"], 1),
                  _num(r["tokens_mean"], 1), _num(r["staleness_mean"], 2)) for r in self.step_ranges]))
        if self.staleness:
            total = sum(self.staleness.values())
            parts.append(format_table(("staleness", "trajectories", "share"),
                                      [(str(k), f"{v:,}", f"{v / total:.1%}") for k, v in self.staleness.items()]))
        p = self.partial
        lines = [f"partial rollouts: {p['trajectories']:,} trajectories had a generation cut and continued"]
        lines += [f"  written by {k} version{'s' if k != 1 else ''}: {v:,}" for k, v in p["by_versions"].items()]
        parts.append("\n".join(lines))
        return "\n\n".join(parts)


def summarize(run: Run) -> Summary:
    df = run.trajectories()
    counts = run.store.counts
    status_counts = df["status"].value_counts()
    by_status = {s.value: int(status_counts.get(s.value, 0)) for s in Status}
    rewarded = df[df["status"].isin([Status.FINISHED.value, Status.CONSUMED.value])]["reward"].dropna()
    trained = df[df["consumed_step"].notna()]
    times = [t for t in (df["created"].min(), df["updated"].max()) if len(df) and not pd.isna(t)]
    store = {"path": str(run.path), "schema": run.schema, "sessions": run.store.session,
             "trajectories": len(df), "tokens": counts["tokens/ids"],
             "generated_tokens": int(df["generated_tokens"].sum()),
             "steps": int(trained["consumed_step"].nunique()),
             "last_step": int(trained["consumed_step"].max()) if len(trained) else None,
             "mean_reward": float(rewarded.mean()) if len(rewarded) else None,
             "span_s": float(max(times) - min(times)) if times else None}
    staleness = trained["staleness"].dropna().astype("int64")
    partial = df[df["interruptions"] > 0]
    by_versions = partial["versions"].value_counts().sort_index()
    return Summary(store=store, by_status=by_status, step_ranges=_step_ranges(trained),
                   staleness={int(k): int(v) for k, v in staleness.value_counts().sort_index().items()},
                   partial={"trajectories": len(partial),
                            "by_versions": {int(k): int(v) for k, v in by_versions.items()}},
                   bubble=_bubble(run))


def _bubble(run: Run) -> BubbleFraction | None:
    bubble = run.bubble()
    return bubble if bubble is not None and bubble.overall is not None else None


def _step_ranges(trained: pd.DataFrame) -> list[dict[str, Any]]:
    if not len(trained):
        return []
    step = trained["consumed_step"].astype("int64").to_numpy()
    low, high = int(step.min()), int(step.max())
    width = max(1, -(-(high - low + 1) // STEP_RANGES))  # ceiling: at most STEP_RANGES rows
    bucket = (step - low) // width
    rows = []
    for b, part in trained.groupby(bucket, sort=True):
        steps_in = part["consumed_step"].astype("int64")
        rows.append({"first": low + int(b) * width, "last": min(high, low + (int(b) + 1) * width - 1),
                     "steps": int(steps_in.nunique()), "trajectories": len(part),
                     "reward_mean": _mean(part["reward"]), "generated_mean": _mean(part["generated_tokens"]),
                     "tokens_mean": _mean(part["tokens"]), "staleness_mean": _mean(part["staleness"])})
    return rows


def update_line(run: Run, previous: Summary | None, summary: Summary) -> str:
    """One line for ``--follow``: the time, the counts and what changed since the last line."""
    s = summary.store
    grown = "" if previous is None else f" (+{s['trajectories'] - previous.store['trajectories']:,})"
    last = summary.step_ranges[-1] if summary.step_ranges else None
    parts = [time.strftime("%H:%M:%S"), f"trajectories {s['trajectories']:,}{grown}"]
    parts += [f"{status} {n:,}" for status, n in summary.by_status.items() if n]
    parts.append(f"steps {s['steps']:,}")
    if last is not None:
        parts.append(f"reward {_num(last['reward_mean'], 3)} (steps {last['first']}-{last['last']})")
    return "  ".join(parts)


def run_finished(folder: Path | None) -> bool:
    """Whether the run's event log ends with its ``finished`` event (a stopped run may resume: not finished)."""
    path = None if folder is None else RunPaths(folder).events
    if path is None or not path.is_file():
        return False
    events = read_log(path)  # a last line the controller is writing right now is left out
    return bool(events) and events[-1].get("event") == "finished"


def _mean(values: pd.Series) -> float | None:
    present = values.dropna()
    return float(np.mean(present.to_numpy(np.float64))) if len(present) else None


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
