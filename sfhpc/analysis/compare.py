"""``sfhpc traj compare A B``: two runs side by side: throughput, bubble fraction, reward curves.

Throughput comes from the run's ``metrics.jsonl`` where there is one (tokens trained and generated over
the steps' wall time); without it, from the store alone (generated tokens of the trained trajectories
over the span from the first trajectory to the last consumption mark). The bubble fraction (waiting
rank-seconds over all rank-seconds, per role) comes from the store's timeline; a store without one shows
the mean of a ``bubble_fraction`` per step in ``metrics.jsonl`` where there is one, else "not recorded".
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sfhpc.analysis.run import Run
from sfhpc.table import format_table

CURVE_ROWS = 20  # the side-by-side reward table samples at most this many steps


@dataclasses.dataclass(frozen=True)
class RunFigures:
    name: str
    steps: int
    trajectories: int
    trained_tokens_per_s: float | None
    generated_tokens_per_s: float | None
    throughput_source: str  # "metrics.jsonl" or "store"
    bubble_fraction: float | None  # None: not recorded
    bubble_by_role: dict[str, float | None]  # from the timeline; empty when the store has none
    mean_reward: float | None
    curve: pd.Series  # reward mean per step


@dataclasses.dataclass(frozen=True)
class Comparison:
    a: RunFigures
    b: RunFigures

    def rows(self) -> list[tuple[str, str, str]]:
        def both(get: Any) -> tuple[str, str]:
            return get(self.a), get(self.b)

        return [
            ("training steps", *both(lambda r: f"{r.steps:,}")),
            ("trajectories", *both(lambda r: f"{r.trajectories:,}")),
            ("trained tokens/s", *both(lambda r: _num(r.trained_tokens_per_s, 0))),
            ("generated tokens/s", *both(lambda r: _num(r.generated_tokens_per_s, 0))),
            ("throughput from", *both(lambda r: r.throughput_source)),
            ("bubble fraction", *both(_bubble_text)),
            ("mean reward", *both(lambda r: _num(r.mean_reward, 4))),
        ]

    def curves(self) -> pd.DataFrame:
        """Reward mean per step of both runs, on the union of their steps (<NA> where one has none)."""
        name_a, name_b = _names(self.a.name, self.b.name)
        return pd.DataFrame({name_a: self.a.curve, name_b: self.b.curve}).sort_index()

    def format(self) -> str:
        names = _names(self.a.name, self.b.name)
        out = [format_table(("", *names), self.rows())]
        curves = self.curves()
        if len(curves):
            picked = curves.iloc[np.unique(np.linspace(0, len(curves) - 1, min(CURVE_ROWS, len(curves))).astype(int))]
            out.append(format_table(("step", *(f"reward {n}" for n in names)),
                                    [(str(step), *(_num(None if pd.isna(v) else float(v), 4) for v in row))
                                     for step, row in picked.iterrows()]))
        return "\n\n".join(out)


def figures(run: Run) -> RunFigures:
    steps = run.steps()
    df = run.trajectories()
    trained = df[df["consumed_step"].notna()]
    curve = trained.groupby(trained["consumed_step"].astype("int64"))["reward"].mean().astype("float64")
    trained_rate = generated_rate = bubble = None
    source = "store"
    if {"trained_tokens", "generated_tokens_per_s", "step_s"} <= set(steps.columns):
        wall = float(steps["step_s"].dropna().sum())
        if wall > 0:
            trained_rate = float(steps["trained_tokens"].dropna().sum()) / wall
            generated_rate = float(steps["metrics_generated_tokens"].dropna().sum()) / wall \
                if "metrics_generated_tokens" in steps else None
            source = "metrics.jsonl"
    if source == "store" and len(trained):
        span = float(run.store.table("marks")["time"].max()) - float(df["created"].min())
        if span > 0:
            generated_rate = float(trained["generated_tokens"].sum()) / span
            trained_rate = float(trained["tokens"].sum()) / span
    timeline = run.bubble()
    by_role: dict[str, float | None] = {}
    if timeline is not None and timeline.overall is not None:
        bubble, by_role = timeline.overall, timeline.by_role
    elif "bubble_fraction" in steps and steps["bubble_fraction"].notna().any():
        bubble = float(steps["bubble_fraction"].dropna().mean())
    rewards = trained["reward"].dropna()
    return RunFigures(name=run.path.parent.name, steps=int(trained["consumed_step"].nunique()), trajectories=len(df),
                      trained_tokens_per_s=trained_rate, generated_tokens_per_s=generated_rate,
                      throughput_source=source, bubble_fraction=bubble, bubble_by_role=by_role,
                      mean_reward=float(rewards.mean()) if len(rewards) else None, curve=curve)


def compare(a: Run, b: Run) -> Comparison:
    return Comparison(figures(a), figures(b))


def plot_rewards(comparison: Comparison, out: Path) -> Path:
    """Both reward curves on one chart (a PNG created at `out`, never over an existing file)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for figs, name in zip((comparison.a, comparison.b), _names(comparison.a.name, comparison.b.name)):
        ax.plot(figs.curve.index, figs.curve.to_numpy(), label=name)
    ax.set(xlabel="training step", ylabel="mean reward", title="reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    try:
        with out.open("xb") as handle:
            fig.savefig(handle, dpi=100, format="png", metadata={"Panels": "reward"})
    finally:
        plt.close(fig)
    return out


def _bubble_text(figures: RunFigures) -> str:
    if figures.bubble_fraction is None:
        return "not recorded"
    roles = ", ".join(f"{role} {'-' if v is None else f'{v:.1%}'}" for role, v in figures.bubble_by_role.items())
    return f"{figures.bubble_fraction:.1%}" + (f" ({roles})" if roles else "")


def _names(a: str, b: str) -> tuple[str, str]:
    """Column names for the two runs: their folder names, or A and B when those are the same."""
    return (a, b) if a != b else (f"A ({a})", f"B ({b})")


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"
