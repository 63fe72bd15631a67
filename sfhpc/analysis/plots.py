"""The panels of ``sfhpc traj plot`` (and of the report): a run over its training steps, as one PNG.

Each panel is a `Panel`: a title and a function that draws it from the run's data or says it has
nothing to draw (None). Panels without data are left out: the per-rank timeline (a Gantt chart of every
rank's states over the run, with the bubble fraction in its title) is drawn only for a store that has one.
The PNG names its panels in its metadata (key ``Panels``), for tools and tests to check.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np
import pandas as pd

from sfhpc.analysis.run import Run
from sfhpc.data.rank_intervals import BubbleFraction
from sfhpc.errors import SfhpcError

PANELS_KEY = "Panels"


@dataclasses.dataclass(frozen=True)
class PlotData:
    """What the panels are drawn from: per training step, and over the whole run."""

    steps: pd.DataFrame  # step, reward_mean, generated_mean (generated tokens per trajectory)
    staleness: pd.Series  # per consumed trajectory: versions behind the trainer when trained
    tokens_by_version: dict[int, int]
    timeline: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)  # `Run.timeline()`
    bubble: BubbleFraction | None = None

    @classmethod
    def of(cls, run: Run) -> PlotData:
        df = run.trajectories()
        trained = df[df["consumed_step"].notna()]
        by_step = trained.groupby(trained["consumed_step"].astype("int64"), sort=True)
        steps = pd.DataFrame({"reward_mean": by_step["reward"].mean().astype("float64"),
                              "generated_mean": by_step["generated_tokens"].mean().astype("float64")})
        steps = steps.rename_axis("step").reset_index()
        return cls(steps, trained["staleness"].dropna().astype("int64"), run.tokens_by_version(), run.timeline(),
                   run.bubble())


@dataclasses.dataclass(frozen=True)
class Panel:
    title: str
    draw: Callable[[Any, PlotData], bool]  # (axes, data) -> False when there is nothing to draw


def _reward(ax: Any, data: PlotData) -> bool:
    if not data.steps["reward_mean"].notna().any():
        return False
    ax.plot(data.steps["step"], data.steps["reward_mean"], color="tab:blue")
    ax.set(xlabel="training step", ylabel="mean reward")
    _whole_numbers(ax)
    return True


def _length(ax: Any, data: PlotData) -> bool:
    if not len(data.steps):
        return False
    ax.plot(data.steps["step"], data.steps["generated_mean"], color="tab:green")
    ax.set(xlabel="training step", ylabel="generated tokens per trajectory")
    _whole_numbers(ax)
    return True


def _staleness(ax: Any, data: PlotData) -> bool:
    if not len(data.staleness):
        return False
    top = int(data.staleness.max())
    counts = np.bincount(data.staleness.to_numpy(np.int64), minlength=top + 1)
    ax.bar(np.arange(top + 1), counts, color="tab:orange", width=0.8)
    ax.set(xlabel="versions behind the trainer", ylabel="trajectories", xticks=list(range(top + 1)))
    return True


def _versions(ax: Any, data: PlotData) -> bool:
    if not data.tokens_by_version:
        return False
    low, high = min(data.tokens_by_version), max(data.tokens_by_version)
    counts = [data.tokens_by_version.get(v, 0) for v in range(low, high + 1)]
    # One filled area for every version (a run has thousands: a bar each would take a minute to draw).
    ax.fill_between(np.arange(low, high + 2) - 0.5, [*counts, counts[-1]], step="post", color="tab:purple",
                    linewidth=0)
    ax.set_ylim(bottom=0)
    ax.set(xlabel="policy version", ylabel="generated tokens")
    _whole_numbers(ax)
    return True


# One colour per state; waiting (the bubble) stands out in grey against the working states.
STATE_COLOURS = {"generating": "tab:green", "training": "tab:blue", "syncing": "tab:orange", "lent": "tab:purple",
                 "waiting": "lightgrey"}
MAX_LABELLED_RANKS = 12  # beyond this many ranks the timeline labels only some of them


def _timeline(ax: Any, data: PlotData) -> bool:
    """Every rank's states over the run, one row per rank (a Gantt chart)."""
    timeline = data.timeline
    if not len(timeline):
        return False
    start = float(timeline["t_start"].min())
    ranks = sorted(timeline["rank"].unique().tolist())
    roles = timeline.groupby("rank")["role"].first()
    for row, rank in enumerate(ranks):
        mine = timeline[timeline["rank"] == rank]
        for state, part in mine.groupby("state", sort=False):
            bars = list(zip((part["t_start"] - start).to_numpy(), part["seconds"].to_numpy()))
            ax.broken_barh(bars, (row - 0.4, 0.8), color=STATE_COLOURS.get(str(state), "black"), linewidth=0)
    bubble = data.bubble
    by_role = {} if bubble is None else bubble.by_role
    if len(ranks) <= MAX_LABELLED_RANKS:
        ax.set_yticks(range(len(ranks)), [f"{rank} {roles[rank]}" + (f"\n{by_role[roles[rank]]:.0%} waiting"
                                                                      if by_role.get(roles[rank]) is not None else "")
                                          for rank in ranks], fontsize="small")
    else:  # many ranks: a few rank numbers along the axis
        ticks = np.unique(np.linspace(0, len(ranks) - 1, MAX_LABELLED_RANKS).astype(int))
        ax.set_yticks(ticks, [str(ranks[i]) for i in ticks], fontsize="small")
        ax.set_ylabel("rank")
    ax.set_ylim(-0.6, len(ranks) - 0.4)
    ax.invert_yaxis()
    ax.set(xlabel="seconds since the run started")
    from matplotlib.patches import Patch

    present = [s for s in STATE_COLOURS if s in set(timeline["state"])]
    ax.legend(handles=[Patch(color=STATE_COLOURS[s], label=s) for s in present], fontsize="x-small",
              loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(present), frameon=False,
              handlelength=1, columnspacing=0.8)
    if bubble is not None and bubble.overall is not None:
        ax.set_title(f"rank timeline: bubble {bubble.overall:.1%}", pad=16)
    return True


def _whole_numbers(ax: Any) -> None:
    """Steps and versions are whole numbers: no tick at 0.5."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))


PANELS = (Panel("reward", _reward), Panel("reply length", _length), Panel("staleness when trained", _staleness),
          Panel("tokens per policy version", _versions), Panel("rank timeline", _timeline))


def draw(data: PlotData, target: Path | IO[bytes], title: str = "") -> list[str]:
    """Draw every panel that has data into one PNG at `target`; returns the titles drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.4))
    drawn = []
    for panel, ax in zip(PANELS, axes):
        if panel.draw(ax, data):
            if not ax.get_title():  # (a panel may title itself with a figure of its own)
                ax.set_title(panel.title)
            ax.grid(alpha=0.3)
            drawn.append(panel.title)
        else:
            fig.delaxes(ax)
    if not drawn:
        plt.close(fig)
        raise SfhpcError("no trajectory was trained on yet: nothing to plot")
    if len(drawn) < len(PANELS):  # close the gaps the missing panels left
        for i, ax in enumerate(fig.axes):
            ax.set_subplotspec(fig.add_gridspec(1, len(drawn))[i])
        fig.set_size_inches(4 * len(drawn), 3.4)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(target, dpi=100, format="png", metadata={PANELS_KEY: "; ".join(drawn)})
    plt.close(fig)
    return drawn


def png_bytes(data: PlotData, title: str = "") -> tuple[bytes, list[str]]:
    """The PNG as bytes (for a report), and the titles drawn."""
    buffer = io.BytesIO()
    drawn = draw(data, buffer, title)
    return buffer.getvalue(), drawn
