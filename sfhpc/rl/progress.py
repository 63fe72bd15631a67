"""Progress of a run: one line per step on the terminal, a JSON line per step on disk, the reward curve.

Long runs show steps, reward and throughput as they go; at the end the reward curve is printed (so a
terminal shows it) and drawn to ``reward.png`` next to the metrics. The same per-step values also go to a
TensorBoard event file beside ``metrics.jsonl`` (`sfhpc.rl.tfevents`), for ``tensorboard --logdir runs/``,
and to the experiment trackers the recipe names (`sfhpc.rl.trackers`: wandb, MLflow). An evaluation's scores
(`sfhpc.rl.evaluation`) ride in the row of the step whose weights they score; the evaluation before training
has a row of its own, step 0, and is drawn on the plot with the others.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from sfhpc.data.run_log import is_evaluation_row, is_training_row, repair_log
from sfhpc.rl.tfevents import EventFile, rewrite
from sfhpc.rl.trackers import Trackers
from sfhpc.rundir import RunPaths

SPARK = " .:-=+*#%@"


class Progress:
    def __init__(self, run_dir: Path, total_steps: int, trackers: Trackers | None = None) -> None:
        self.paths = RunPaths(run_dir)
        self.path = self.paths.metrics
        # A folder opened again: a crash may have cut the last row, which is set aside before one is appended.
        repair_log(self.path)
        self.total = total_steps
        self.started = time.monotonic()
        self.rows: list[dict[str, Any]] = []  # a row per training step
        self.evaluations: list[dict[str, Any]] = []  # the rows that hold an evaluation (`sfhpc.rl.evaluation`)
        self.events: EventFile | None = None  # opened at the first step (or at a resume)
        self.trackers = trackers

    def resume(self, step: int) -> None:
        """Continue the metrics of a run restored at `step`: its rows up to that step are the curve so far.
        Rows of later steps (trained after the checkpoint, by weights the restart lost) move to
        ``metrics-discarded.jsonl``, so that no step appears twice in ``metrics.jsonl``."""
        if not self.path.exists():
            return
        rows = repair_log(self.path)
        kept = [r for r in rows if r["step"] <= step]
        later = [r for r in rows if r["step"] > step]
        self.rows = [r for r in kept if is_training_row(r)]
        self.evaluations = [r for r in kept if is_evaluation_row(r)]
        # The event files likewise: one new file with the kept steps replaces the earlier sessions' files.
        self.events = rewrite(self.path.parent, kept)
        if not later:
            return
        with open(self.paths.metrics_discarded, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in later)
        temporary = self.path.with_name(".metrics.jsonl.tmp")
        temporary.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        temporary.replace(self.path)

    def _append(self, row: dict[str, Any]) -> dict[str, Any]:
        """`row` (with the elapsed time) to ``metrics.jsonl``, the event file and the trackers."""
        row = {**row, "elapsed_s": round(time.monotonic() - self.started, 3)}
        if is_evaluation_row(row):
            self.evaluations.append(row)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self.events is None:
            self.events = EventFile(self.path.parent)
        self.events.add(int(row["step"]), row)
        if self.trackers is not None:
            self.trackers.log(row)
        return row

    def evaluated_before_training(self, row: dict[str, Any]) -> None:
        """The row of step 0: the evaluation of the initial policy (``eval_`` keys alone)."""
        self._append({"step": 0, "version": 0, **row})

    def step(self, row: dict[str, Any]) -> None:
        row = self._append(row)
        self.rows.append(row)
        print(f"step {row['step']:>4}/{self.total}  reward {row['reward_mean']:.3f}  "
              f"staleness {row.get('mean_staleness', 0):.2f}  gen {row['generated_tokens_per_s']:>7.0f} tok/s  "
              f"train {row['trained_tokens_per_s']:>7.0f} tok/s  sync {row['sync_s'] * 1000:.0f} ms  "
              f"[{row['elapsed_s']:.0f} s]", flush=True)

    def curve(self, window: int = 5) -> str:
        """The reward per step as one line of text (moving average over `window` steps), with first/last."""
        rewards = [r["reward_mean"] for r in self.rows]
        if not rewards:
            return "reward curve: no training step was run"
        smooth = moving_average(rewards, window)
        width = min(len(smooth), 60)  # one character per bin of steps: fits a terminal line
        bins = [smooth[i * len(smooth) // width:(i + 1) * len(smooth) // width] for i in range(width)]
        spark = "".join(SPARK[min(len(SPARK) - 1, int(max(0.0, sum(b) / len(b)) * len(SPARK)))] for b in bins)
        tenth = max(1, len(rewards) // 10)
        first, last = sum(rewards[:tenth]) / tenth, sum(rewards[-tenth:]) / tenth
        return (f"reward curve (0 to 1, {len(rewards)} steps, moving average of {window}): |{spark}|\n"
                f"mean reward: first {tenth} step(s) {first:.3f} -> last {tenth} step(s) {last:.3f}")

    def evaluation_line(self) -> str | None:
        """The first and the last evaluation's pass@1 (None: the run evaluated nothing)."""
        if not self.evaluations:
            return None
        first, last = self.evaluations[0], self.evaluations[-1]
        rise = "" if len(self.evaluations) == 1 else \
            f"{first['eval_pass_at_1']:.3f} (version {first['eval_version']}) -> "
        count = "1 evaluation" if len(self.evaluations) == 1 else f"{len(self.evaluations)} evaluations"
        return (f"evaluation pass@1: {rise}{last['eval_pass_at_1']:.3f} (version {last['eval_version']}), {count} of "
                f"{last['eval_problems']} held-out problems")

    def end(self, *, complete: bool) -> Path | None:
        """The run's end on this rank (`complete`: its budget spent, not stopped for a requeue): the reward plot
        is drawn and the trackers get it and close. Returns the plot (None without matplotlib)."""
        plot = self.plot()
        if self.trackers is not None:
            self.trackers.finish(plot, complete=complete)
        return plot

    def plot(self) -> Path | None:
        """Draw reward.png (reward and staleness per step); None when matplotlib is missing."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        steps = [r["step"] for r in self.rows]
        fig, ax = plt.subplots(figsize=(7, 3.5))
        rewards = [r["reward_mean"] for r in self.rows]
        window = max(1, len(rewards) // 40)
        smooth = moving_average(rewards, window)
        ax.plot(steps, rewards, color="tab:blue", alpha=0.35, label="mean reward per step")
        ax.plot(steps, smooth, color="tab:blue", label=f"moving average ({window} steps)")
        if self.evaluations:  # held-out pass@1, at the step whose weights were evaluated
            ax.plot([r["step"] for r in self.evaluations], [r["eval_pass_at_1"] for r in self.evaluations],
                    color="tab:orange", marker="o", label="evaluation pass@1 (held out)")
        ax.set_xlabel("training step")
        ax.set_ylabel("mean reward" if not self.evaluations else "reward, pass@1")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left")
        fig.tight_layout()
        out = self.paths.reward_plot
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out


def moving_average(values: list[float], window: int) -> list[float]:
    """Mean of each value and the up to ``window - 1`` before it (shorter at the start)."""
    return [sum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1): i + 1])
            for i in range(len(values))]
