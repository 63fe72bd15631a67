"""``sfhpc traj report``: one self-contained HTML file about a run, to read in a browser or send on.

Self-contained: the plots are inlined as base64 PNG, the style is inline, nothing is fetched. It holds
the summary's tables, the plot panels, the training steps, and a few sample conversations (the best and
the worst rewarded, a partial rollout, the latest trained) as ``sfhpc traj show`` prints them.
The file is only ever created, never overwritten; one that fails half-way is removed.
"""

from __future__ import annotations

import base64
import contextlib
import html
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from sfhpc.analysis.conversation import format_conversation
from sfhpc.analysis.plots import PlotData, png_bytes
from sfhpc.analysis.run import Run
from sfhpc.analysis.summary import Summary, summarize
from sfhpc.analysis.trace import run_trace
from sfhpc.data.store import ConsumptionMark
from sfhpc.errors import SfhpcError

MAX_STEP_ROWS = 40  # the steps table shows the first and last ones beyond this
STYLE = """body{font-family:sans-serif;margin:2em;max-width:80em;color:#222}
table{border-collapse:collapse;margin:0.5em 0 1.5em}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}
th{background:#f2f2f2}td:first-child,th:first-child{text-align:left}img{max-width:100%}
pre{background:#f7f7f7;padding:0.8em;overflow-x:auto;font-size:85%}h2{border-bottom:1px solid #ddd}"""


def write_report(run: Run, out: Path) -> Path:
    text = report_html(run)
    try:
        with out.open("x", encoding="utf-8") as handle:  # "x": never overwrite a user's file
            handle.write(text)
    except FileExistsError:
        raise SfhpcError(f"{out} exists; choose another --out (nothing was written)") from None
    except BaseException:
        with contextlib.suppress(OSError):
            out.unlink()
        raise
    return out


def report_html(run: Run) -> str:
    summary = summarize(run)
    steps = run.steps()
    title = f"sfhpc run {run.path.parent.name}"
    body = [f"<h1>{_e(title)}</h1>",
            f"<p>{_e(str(run.path))}, read {_e(time.strftime('%Y-%m-%d %H:%M:%S'))}</p>",
            "<h2>Store</h2>", _summary_tables(summary), "<h2>Plots</h2>", _plots(run, title),
            "<h2>Training steps</h2>", _steps_table(steps), *_evaluations(steps),
            "<h2>Sample conversations</h2>", _samples(run)]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{STYLE}</style></head>\n<body>\n" + "\n".join(body)
            + "\n</body></html>\n")


def _summary_tables(summary: Summary) -> str:
    s = summary.store
    parts = [_table(("store", ""), [("trajectories", f"{s['trajectories']:,}"), ("tokens", f"{s['tokens']:,}"),
                               ("generated tokens", f"{s['generated_tokens']:,}"),
                               ("training steps", f"{s['steps']:,}"), ("writer sessions", str(s["sessions"])),
                               ("mean reward", _num(s["mean_reward"], 4))])]
    parts.append(_table(("status", "trajectories"), [(k, f"{v:,}") for k, v in summary.by_status.items() if v]))
    if summary.step_ranges:
        parts.append(_table(("steps", "trajectories", "mean reward", "generated tokens", "mean staleness"),
                            [(f"{r['first']}-{r['last']}", f"{r['trajectories']:,}", _num(r["reward_mean"], 4),
                              _num(r["generated_mean"], 1), _num(r["staleness_mean"], 2))
                             for r in summary.step_ranges]))
    if summary.staleness:
        parts.append(_table(("staleness", "trajectories"), [(str(k), f"{v:,}") for k, v in summary.staleness.items()]))
    p = summary.partial
    parts.append(_table(("partial rollouts", "trajectories"),
                        [("cut and continued", f"{p['trajectories']:,}")]
                        + [(f"written by {k} version(s)", f"{v:,}") for k, v in p["by_versions"].items()]))
    return "\n".join(parts)


def _plots(run: Run, title: str) -> str:
    try:
        png, panels = png_bytes(PlotData.of(run), title)
    except SfhpcError as exc:  # nothing trained yet: the report says so instead
        return f"<p>{_e(str(exc))}</p>"
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{_e(", ".join(panels))}" src="data:image/png;base64,{data}">' + _trace_link(run)


def _trace_link(run: Run) -> str:
    """The rank timeline as a Chrome trace, inside the report (a download link), to open in Perfetto."""
    timeline = run.timeline()
    if not len(timeline):
        return ""
    trace = run_trace(run.path.parent, timeline)
    data = base64.b64encode(json.dumps(trace).encode("utf-8")).decode("ascii")
    return (f'<p><a download="{_e(run.path.parent.name)}-trace.json" href="data:application/json;base64,{data}">'
            "the rank timeline as a trace</a> (save it, then open it in "
            '<a href="https://ui.perfetto.dev">Perfetto</a> or chrome://tracing; '
            "<code>sfhpc traj trace</code> writes one for a range of steps or ranks)</p>")


def _steps_table(steps: pd.DataFrame) -> str:
    if "eval_pass_at_1" in steps and "reward_mean" in steps:  # not the row of the evaluation before training
        steps = steps[~(steps["reward_mean"].isna() & steps["eval_pass_at_1"].notna())]
    if not len(steps):
        return "<p>no training step yet</p>"
    columns = [c for c in ("step", "policy_version", "trajectories", "reward_mean", "generated_tokens",
                           "mean_staleness", "loss", "trained_tokens_per_s", "step_s") if c in steps]
    shown = steps if len(steps) <= MAX_STEP_ROWS else pd.concat([steps.head(MAX_STEP_ROWS // 2),
                                                                 steps.tail(MAX_STEP_ROWS // 2)])
    rows = [tuple(_cell(row[c]) for c in columns) for _, row in shown.iterrows()]
    note = "" if len(steps) <= MAX_STEP_ROWS else f"<p>first and last {MAX_STEP_ROWS // 2} of {len(steps):,} steps</p>"
    return note + _table(tuple(columns), rows)


def _evaluations(steps: pd.DataFrame) -> list[str]:
    """The held-out evaluations of the run (``eval_`` fields of ``metrics.jsonl``), a heading and a table; none
    without any."""
    if "eval_pass_at_1" not in steps:
        return []
    rows = steps[steps["eval_pass_at_1"].notna()]
    columns = [c for c in ("step", "eval_version", "eval_problems", "eval_k", "eval_pass_at_1", "eval_mean_at_k",
                           "eval_pass_at_k", "eval_failed") if c in rows]
    return ["<h2>Evaluations on held-out problems</h2>",
            _table(tuple(c.removeprefix("eval_") for c in columns),
                   [tuple(_cell(row[c]) for c in columns) for _, row in rows.iterrows()])]


def _samples(run: Run) -> str:
    df = run.trajectories()
    rewarded = df[df["reward"].notna()]
    picks: dict[str, str] = {}  # id -> why it was picked
    if len(rewarded):
        # The first of the best and the last of the worst: two samples even when every reward is equal.
        best = str(rewarded.loc[rewarded["reward"].idxmax(), "id"])
        worst = str(rewarded.loc[rewarded["reward"][::-1].idxmin(), "id"])
        picks[best] = "best reward" if best != worst else "best and worst reward"
        picks.setdefault(worst, "worst reward")
    partial = df[df["interruptions"] > 0]
    if len(partial):
        picks.setdefault(str(partial.iloc[-1]["id"]), "a partial rollout (cut by a weight update, continued)")
    trained = df[df["consumed_step"].notna()]
    if len(trained):
        picks.setdefault(str(trained.iloc[-1]["id"]), "the latest trained")
    if not picks:
        return "<p>no trajectory yet</p>"
    rows = df.set_index("id")
    parts = []
    for tid, why in picks.items():
        row = rows.loc[tid]
        mark = None if pd.isna(row["consumed_step"]) else ConsumptionMark(
            int(row["consumed_step"]), tid, int(row["trained_version"]), 0.0)
        text = format_conversation(run, run.trajectory(tid), mark)
        parts.append(f"<h3>{_e(why)}: {_e(tid)} (reward {_cell(row['reward'])})</h3><pre>{_e(text)}</pre>")
    return "\n".join(parts)


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(value: Any) -> str:
    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _e(text: str) -> str:
    return html.escape(text, quote=True)
