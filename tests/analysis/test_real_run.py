"""The analysis on a store and run folder made by a real run of the project (``sfhpc run``: MPI ranks,
torch training, the trajectory manager and store; the deterministic test engine generates, as it does
for the phase tests): the summary's counts are what the run recorded, its TensorBoard event file holds
the steps of its ``metrics.jsonl``, and its report renders."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

from sfhpc.analysis import open_run
from sfhpc.analysis.summary import summarize
from sfhpc.data.store import open_store
from tests.conftest import run_sfhpc

pytestmark = [pytest.mark.mpi]

STEPS, PROMPTS, GROUP = 3, 2, 2
RECIPE = f"""\
name: analysed
seed: 2
engine: {{name: test}}
algorithm: {{group_size: {GROUP}}}
pipeline: {{mode: async, max_staleness: 1}}
budgets: {{steps: {STEPS}, prompts_per_step: {PROMPTS}}}
task: {{name: next-letter}}
roles:
  controller: {{place_with: trainer}}
  trainer:    {{tags: [train], nodes: 1}}
  rollout:    {{tags: [rollout], nodes: 1}}
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("real")
    recipe = folder / "recipe.yaml"
    recipe.write_text(RECIPE + f"output_dir: {folder / 'runs'}\n")
    done = run_sfhpc("run", str(recipe), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    (folder / "stdout.txt").write_text(done.stdout)  # what the run printed at its end
    return run_dir


def test_summary_counts_what_the_run_recorded(run_dir: Path) -> None:
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    with open_run(run_dir) as run:
        summary = summarize(run)
        steps = run.steps()
    assert summary.store["steps"] == STEPS
    assert summary.by_status["consumed"] == sum(m["trajectories"] for m in metrics) == STEPS * PROMPTS * GROUP
    trained = {r["first"]: r["trajectories"] for r in summary.step_ranges}
    assert trained == {m["step"]: m["trajectories"] for m in metrics}
    # The store's rewards per step are the ones the controller reported.
    np.testing.assert_allclose(steps["reward_mean"].astype(float), [m["reward_mean"] for m in metrics])
    done = run_sfhpc("traj", "summary", str(run_dir))
    assert done.returncode == 0, done.stderr
    assert ["consumed", str(STEPS * PROMPTS * GROUP)] in [line.split() for line in done.stdout.splitlines()]
    # Every step's row counts the policy tokens dropped since the one before, by cause; what the rows count
    # was dropped in the store (a drop after the last row is in the store only).
    with open_store(run_dir / "trajectories.h5") as store:
        generated = {status: sum(t.num_generated for t in store.trajectories(status))
                     for status in ("stale", "aborted", "failed")}
    for cause in ("stale", "aborted", "failed", "off_branch"):
        assert all(m[f"dropped_tokens_{cause}"] >= 0 for m in metrics)
        if cause in generated:
            assert sum(m[f"dropped_tokens_{cause}"] for m in metrics) <= generated[cause]


def test_the_run_wrote_its_metrics_for_tensorboard(run_dir: Path) -> None:
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    files = list(run_dir.glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    events = EventAccumulator(str(files[0]), size_guidance={SCALARS: 0})
    events.Reload()
    for tag in ("reward_mean", "trained_tokens_per_s", "loss", "step_s"):
        assert [e.step for e in events.Scalars(tag)] == [m["step"] for m in metrics], tag
        assert [e.value for e in events.Scalars(tag)] == np.float32([m[tag] for m in metrics]).tolist(), tag


def test_report_of_the_run(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    done = run_sfhpc("traj", "report", str(run_dir), "-o", str(out))
    assert done.returncode == 0, done.stderr
    page = out.read_text()
    assert page.count("data:image/png;base64,") == 1 and "best reward:" in page and "worst reward:" in page


def test_the_store_holds_every_ranks_timeline_and_the_printed_bubble_fraction(run_dir: Path) -> None:
    """Rank 1 trains, rank 2 rolls out (the controller, rank 0, has no working state). Their intervals
    follow each other without a gap from the run's start to its end, the trainer trained once per step,
    and the fraction the run printed is the one the store's timeline gives."""
    printed = re.search(r"bubble fraction: ([\d.]+)% \(trainer ([\d.]+)%, rollout ([\d.]+)%\)",
                        (run_dir.parent.parent / "stdout.txt").read_text())
    assert printed, "the run prints its bubble fraction"
    with open_store(run_dir / "trajectories.h5") as store:
        rows = store.table("timeline")
        bubble = store.bubble()
        created = store.table("trajectories")["created"]
    assert sorted(set(rows["rank"].tolist())) == [1, 2]
    for rank, role in ((1, b"trainer"), (2, b"rollout")):
        mine = rows[rows["rank"] == rank]
        assert set(mine["role"].tolist()) == {role}
        np.testing.assert_array_equal(mine["t_start"][1:], mine["t_end"][:-1])  # back to back, in order
        assert (mine["t_end"] > mine["t_start"]).all() and mine["t_start"][0] <= created.min()
        assert set(mine["state"].tolist()) <= {b"generating", b"training", b"syncing", b"waiting"}
    trainer = rows[rows["rank"] == 1]
    assert trainer[trainer["state"] == b"training"]["step"].tolist() == list(range(1, STEPS + 1))
    assert b"generating" in rows[rows["rank"] == 2]["state"].tolist()
    spans = {rank: rows[rows["rank"] == rank]["t_end"].max() - rows[rows["rank"] == rank]["t_start"].min()
             for rank in (1, 2)}
    assert abs(spans[1] - spans[2]) < 1.0  # both on the timeline for the whole run
    assert 0 < bubble.overall < 1 and bubble.of("trainer") > 0  # the trainer waits for its batches
    expected = [100 * bubble.overall, 100 * bubble.of("trainer"), 100 * bubble.of("rollout")]
    np.testing.assert_allclose([float(g) for g in printed.groups()], expected, atol=0.051)
    done = run_sfhpc("traj", "summary", str(run_dir))
    assert done.returncode == 0, done.stderr
    assert re.search(rf"^bubble fraction +{re.escape(bubble.format())}$", done.stdout, re.M), done.stdout
