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
    return Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]


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
