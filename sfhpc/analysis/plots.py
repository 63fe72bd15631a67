"""The panels of ``sfhpc traj plot`` (and of the report): a run over its training steps, as one PNG.

Each panel is a `Panel`: a title and a function that draws it from the run's data or says it has
nothing to draw (None). Panels without data are left out, so a panel whose data only some runs record
(the per-rank timeline, once runs record one) is one more entry in `PANELS`.
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
from sfhpc.errors import SfhpcError

PANELS_KEY = "Panels"


@dataclasses.dataclass(frozen=True)
class PlotData:
    """What the panels are drawn from: per training step, and over the whole run."""

    steps: pd.DataFrame  # step, reward_mean, generated_mean (generated tokens per trajectory)
    staleness: pd.Series  # per consumed trajectory: versions behind the trainer when trained
    tokens_by_version: dict[int, int]

    @classmethod
    def of(cls, run: Run) -> PlotData:
        df = run.trajectories()
        trained = df[df["consumed_step"].notna()]
        by_step = trained.groupby(trained["consumed_step"].astype("int64"), sort=True)
        steps = pd.DataFrame({"reward_mean": by_step["reward"].mean().astype("float64"),
                              "generated_mean": by_step["generated_tokens"].mean().astype("float64")})
        steps = steps.rename_axis("step").reset_index()
        return cls(steps, trained["staleness"].dropna().astype("int64"), run.tokens_by_version())


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


def _whole_numbers(ax: Any) -> None:
    """Steps and versions are whole numbers: no tick at 0.5."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))


PANELS = (Panel("reward", _reward), Panel("reply length", _length), Panel("staleness when trained", _staleness),
          Panel("tokens per policy version", _versions))


def draw(data: PlotData, target: Path | IO[bytes], title: str = "") -> list[str]:
    """Draw every panel that has data into one PNG at `target`; returns the titles drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.4))
    drawn = []
    for panel, ax in zip(PANELS, axes):
        if panel.draw(ax, data):
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
