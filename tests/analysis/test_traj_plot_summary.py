"""``sfhpc traj summary`` (its sections) and ``sfhpc traj plot`` (its panels) on the manager-written run;
the whole-table columns equal `trajectory_row` record by record (and the CSV export the rows' CSV)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sfhpc.analysis import open_run, trajectory_row, trajectory_rows, write_csv
from sfhpc.analysis.columns import store_columns
from sfhpc.analysis.export import write_frame
from sfhpc.analysis.plots import PANELS_KEY
from sfhpc.analysis.summary import summarize
from sfhpc.bench.analysis import build_store
from sfhpc.data import open_store
from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.store import TrajectoryStore
from tests.analysis.runs import write_run
from tests.conftest import assert_one_line_error, run_sfhpc
from tests.data.records import make_trajectory


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_run(tmp_path_factory.mktemp("summary") / "run")


def test_summary_sections(run_dir: Path) -> None:
    with open_run(run_dir) as run:
        summary = summarize(run)
    assert summary.by_status == {"running": 1, "interrupted": 0, "finished": 0, "consumed": 3, "stale": 0,
                                 "aborted": 0, "failed": 1, "evaluated": 0, "filtered": 0}
    assert summary.store["trajectories"] == 5 and summary.store["steps"] == 2 and summary.store["last_step"] == 1
    # step 0 trained plain (reward 1, 2 generated tokens) and cut (0.5, 16); step 1 multi (0.0, 5).
    ranges = [(r["first"], r["last"], r["trajectories"], r["reward_mean"], r["generated_mean"])
              for r in summary.step_ranges]
    assert ranges == [(0, 0, 2, 0.75, 9.0), (1, 1, 1, 0.0, 5.0)]
    assert summary.staleness == {1: 3}  # each was trained one version after the one that sampled it
    assert summary.partial == {"trajectories": 1, "by_versions": {2: 1}}  # cut: versions 1 and 2

    done = run_sfhpc("traj", "summary", str(run_dir))
    assert done.returncode == 0, done.stderr
    lines = [line.split() for line in done.stdout.splitlines()]
    assert ["consumed", "3"] in lines and ["failed", "1"] in lines and ["running", "1"] in lines
    assert ["0", "2", "0.7500", "9.0", "25.0", "1.00"] in lines  # steps, trajectories, reward, generated, tokens
    assert ["1", "3", "100.0%"] in lines  # staleness 1: all three
    assert "partial rollouts: 1 trajectories had a generation cut and continued" in done.stdout
    assert "written by 2 versions: 1" in done.stdout


def test_plot_has_its_panels_and_leaves_out_those_without_data(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "p.png"
    done = run_sfhpc("traj", "plot", str(run_dir), "--out", str(out))
    assert done.returncode == 0, done.stderr
    with Image.open(out) as png:
        assert png.format == "PNG" and png.size[0] > 1200
        assert png.text[PANELS_KEY] == "reward; reply length; staleness when trained; tokens per policy version"
    # Trained trajectories without generated tokens: no staleness, no versions: two panels, a narrower image.
    bare = tmp_path / "bare"
    bare.mkdir()
    manager = TrajectoryManager(TrajectoryStore.create(bare / "trajectories.h5"))
    for j in range(2):
        manager.start([1, 2], group="g", trajectory_id=f"b{j}")
        manager.finish(f"b{j}", reward=float(j))
    assert manager.take_batch(policy_version=0, num_groups=1, group_size=2) is not None
    manager.close()
    done = run_sfhpc("traj", "plot", str(bare))
    assert done.returncode == 0, done.stderr
    with Image.open(bare / "trajectories.png") as png:
        assert png.text[PANELS_KEY] == "reward; reply length" and png.size[0] < 1000


def test_whole_table_columns_equal_the_per_record_definition(run_dir: Path, tmp_path: Path) -> None:
    forked = tmp_path / "forked.h5"
    with TrajectoryStore.create(forked) as store:
        for i in (3, 7, 14):  # each with a fork: two of its segments are off its current branch
            store.write(make_trajectory(i))
            # ... between chains (its first four segments) and a header without segments yet
            store.write(dataclasses.replace(make_trajectory(i + 1), id=f"chain-{i}",
                                            segments=make_trajectory(i + 1).segments[:4]))
            store.add_trajectory(f"bare-{i}")
        store.mark_consumed(0, ["traj-000003", "chain-7", "traj-000014"], policy_version=2)
    build_store(tmp_path / "synthetic.h5", 300)  # the benchmark's store: cut replies, stale and failed ones
    for path in (run_dir / "trajectories.h5", forked, tmp_path / "synthetic.h5"):
        with open_store(path) as store:
            columns = store_columns(store).columns
            marks = {m.trajectory_id: m for m in store.marks()}
            for row, trajectory in enumerate(store.trajectories()):
                expected = trajectory_row(trajectory, marks.get(trajectory.id))
                got = {name: _missing_as_none(name, columns[name][row]) for name in expected}
                assert got == expected, (path.name, trajectory.id)
            write_csv(trajectory_rows(store), tmp_path / f"{path.stem}-rows.csv")
        with open_run(path) as run:  # the CSV export from the frame: byte for byte the rows' CSV
            write_frame(run.trajectories(), tmp_path / f"{path.stem}-frame.csv", "csv")
        assert (tmp_path / f"{path.stem}-frame.csv").read_bytes() == (tmp_path / f"{path.stem}-rows.csv").read_bytes()


def _missing_as_none(name: str, value: object) -> object:
    """The columns' NaN (rewards) and -1 (versions, steps, staleness) are the definition's None."""
    if isinstance(value, float) and np.isnan(value):
        return None
    return None if name.endswith(("version", "step", "staleness")) and value == -1 else value


def test_summary_and_plot_refuse_bad_input_in_one_line(run_dir: Path, tmp_path: Path) -> None:
    text = tmp_path / "notes.h5"
    text.write_text("not a store\n")
    for command in ("summary", "plot", "report"):
        assert_one_line_error(run_sfhpc("traj", command, str(text)), "is not an HDF5 file")
    existing = tmp_path / "mine.png"
    existing.write_bytes(b"mine")
    assert_one_line_error(run_sfhpc("traj", "plot", str(run_dir), "--out", str(existing)), "exists")
    assert existing.read_bytes() == b"mine"
