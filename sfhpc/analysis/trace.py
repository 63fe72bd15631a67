"""A run's timeline as a Chrome trace (the JSON trace event format that Perfetto and ``chrome://tracing``
open): zoom into one step of one rank instead of reading a PNG.

    sfhpc traj trace runs/demo-... --out trace.json [--steps 100:120] [--ranks 1,2]

What the file holds:

- one process per rank (``rank 2 (rollout)``), sorted by rank, with one track of its states: a complete
  event (``"ph": "X"``) per interval of the store's timeline, named by the state (generating, training,
  syncing, lent, and waiting shown as ``idle``), with the training step it worked towards;
- instant events (``"ph": "i"``) on the controller's track: each weight version the trainers produced
  (``version N``, when the step's training ended), and what the run's ``events.jsonl`` records at a moment:
  reclaims of lent ranks, rebalances, checkpoints, stops, resumes, faults;
- counters (``"ph": "C"``) per step, at the step's end: the bubble (waiting rank-seconds over all, in the
  intervals stamped with the step) and, from ``metrics.jsonl``, the reward, the mean staleness of its
  tokens, the groups in flight, the generated tokens.

Times are microseconds from the earliest interval shown (the format's unit). The format's rules the
writer keeps: every event has ``name``, ``ph``, ``ts``, ``pid`` and ``tid``; complete events have a
non-negative ``dur``; metadata events (``"ph": "M"``) name the processes and threads.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from sfhpc.data.run_log import read_log
from sfhpc.rundir import RunPaths

STATE_NAMES = {"waiting": "idle"}  # the rest keep the timeline's own names
MOMENTS = ("reclaimed", "rebalanced", "checkpoint", "stop-requested", "stopped", "resumed", "fault")
COUNTERS = {"reward": "reward_mean", "staleness": "mean_staleness", "groups in flight": "groups_in_flight",
            "generated tokens": "generated_tokens"}
CONTROLLER_PID = 0


def chrome_trace(timeline: pd.DataFrame, metrics: list[dict[str, Any]], events: list[dict[str, Any]], *,
                 steps: tuple[int, int] | None = None, ranks: Iterable[int] | None = None) -> dict[str, Any]:
    """The trace of a run's `timeline` (`sfhpc.analysis.run.Run.timeline`), its ``metrics.jsonl`` rows and
    ``events.jsonl`` records, restricted to `steps` (inclusive) and `ranks` when given."""
    shown = timeline
    if steps is not None:
        shown = shown[(shown["step"] >= steps[0]) & (shown["step"] <= steps[1])]
    if ranks is not None:
        shown = shown[shown["rank"].isin(list(ranks))]
    if not len(shown):
        return {"traceEvents": [], "displayTimeUnit": "ms", "otherData": {"note": "no timeline in this range"}}
    t0, t1 = float(shown["t_start"].min()), float(shown["t_end"].max())

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 1)

    trace: list[dict[str, Any]] = []
    roles = shown.groupby("rank")["role"].first()
    for rank, role in roles.items():
        trace += [{"name": "process_name", "ph": "M", "pid": int(rank), "tid": 0, "ts": 0,
                   "args": {"name": f"rank {rank} ({role})"}},
                  {"name": "process_sort_index", "ph": "M", "pid": int(rank), "tid": 0, "ts": 0,
                   "args": {"sort_index": int(rank)}},
                  {"name": "thread_name", "ph": "M", "pid": int(rank), "tid": 0, "ts": 0, "args": {"name": "state"}}]
    for row in shown.itertuples(index=False):
        trace.append({"name": STATE_NAMES.get(row.state, row.state), "cat": "state", "ph": "X", "pid": int(row.rank),
                      "tid": 0, "ts": us(row.t_start), "dur": max(0.0, round((row.t_end - row.t_start) * 1e6, 1)),
                      "args": {"step": int(row.step)}})

    def within(time: float | None, step: int | None = None) -> bool:
        if time is None or not t0 <= time <= t1:
            return False
        return steps is None or step is None or steps[0] <= step <= steps[1]

    controller = CONTROLLER_PID  # the weight versions, events and counters: the controller's, on rank 0's track
    if controller not in set(roles.index):
        trace.append({"name": "process_name", "ph": "M", "pid": controller, "tid": 0, "ts": 0,
                      "args": {"name": f"rank {controller} (controller)"}})
    ends = step_ends(timeline)
    bubbles = step_bubbles(timeline)
    for row in metrics:
        end = ends.get(int(row.get("step", -1)))
        if not within(end, row.get("step")):
            continue
        assert end is not None
        trace.append({"name": f"version {row['version']}", "cat": "weights", "ph": "i", "s": "g",
                      "pid": controller, "tid": 0, "ts": us(end), "args": {"step": row["step"]}})
        counters = {name: row[key] for name, key in COUNTERS.items() if row.get(key) is not None}
        if (bubble := bubbles.get(int(row["step"]))) is not None:
            counters["bubble"] = round(bubble, 4)
        trace += [{"name": name, "ph": "C", "pid": controller, "tid": 0, "ts": us(end), "args": {name: value}}
                  for name, value in counters.items()]
    for event in events:
        if event.get("event") in MOMENTS and within(event.get("time"), event.get("step")):
            args = {k: v for k, v in event.items() if k not in ("event", "time")}
            trace.append({"name": event["event"], "cat": "run", "ph": "i", "s": "g", "pid": controller, "tid": 0,
                          "ts": us(event["time"]), "args": args})
    return {"traceEvents": trace, "displayTimeUnit": "ms",
            "otherData": {"source": "sfhpc", "t0_unix_s": t0, "steps": list(steps) if steps else None}}


def step_bubbles(timeline: pd.DataFrame) -> dict[int, float]:
    """Per step, the share of rank-seconds spent waiting in the intervals stamped with it."""
    seconds = timeline["t_end"] - timeline["t_start"]
    waiting = seconds.where(timeline["state"] == "waiting", 0.0)
    totals = pd.DataFrame({"step": timeline["step"], "seconds": seconds, "waiting": waiting}).groupby("step").sum()
    return {int(step): float(w / t) for step, w, t in zip(totals.index, totals["waiting"], totals["seconds"]) if t > 0}


def step_ends(timeline: pd.DataFrame) -> dict[int, float]:
    """When each step's new weights existed (Unix s): the end of the trainers' last ``training`` interval
    stamped with the step (intervals carry the step the run worked towards when they began)."""
    training = timeline[timeline["state"] == "training"]
    return {int(step): float(end) for step, end in training.groupby("step")["t_end"].max().items()}


def run_trace(run_dir: Path, timeline: pd.DataFrame, *, steps: tuple[int, int] | None = None,
              ranks: Iterable[int] | None = None) -> dict[str, Any]:
    """The trace of the run in `run_dir` (its store's `timeline`, its metrics and events logs)."""
    paths = RunPaths(run_dir)
    return chrome_trace(timeline, read_log(paths.metrics), read_log(paths.events), steps=steps, ranks=ranks)


def parse_steps(text: str) -> tuple[int, int]:
    """``A:B`` (inclusive; ``A:`` and ``:B`` open on one side) as a pair of steps; ValueError otherwise."""
    low, sep, high = text.partition(":")
    if not sep:
        low = high = text
    first, last = int(low) if low else 0, int(high) if high else 2**62
    if first > last:
        raise ValueError(f"{text}: the first step is after the last")
    return first, last
