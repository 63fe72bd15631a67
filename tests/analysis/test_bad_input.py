"""Bad input to every ``sfhpc traj`` command: one ``sfhpc: error:`` line and a non-zero exit (or, for an
empty store, an empty but valid result), never a traceback, never a write to the store.

Most cases call the command line's `main` in this process (the same code a user's shell reaches, without
a Python start per case); one case per kind runs ``python -m sfhpc`` as well.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import shutil
import subprocess
from pathlib import Path

import h5py
import pandas as pd
import pytest

from sfhpc.cli import main
from sfhpc.data.layout import SCHEMA_VERSION
from sfhpc.data.store import TrajectoryStore
from tests.analysis.runs import write_run
from tests.conftest import assert_one_line_error, run_sfhpc


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_run(tmp_path_factory.mktemp("bad") / "run")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``sfhpc ARGS`` in this process: its exit code and what it printed (an exception escapes: a traceback)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _reads(store: Path, out: Path) -> list[list[str]]:
    """Every traj command on `store`, each writing (if at all) to a new file under `out`."""
    return [["summary", str(store)], ["plot", str(store), "--out", str(out / "p.png")],
            ["report", str(store), "-o", str(out / "r.html")], ["export", str(store), "--out", str(out / "t.csv")],
            ["export", str(store), "--format", "parquet", "--out", str(out / "t.parquet")],
            ["show", str(store), "plain"], ["compare", str(store), str(store)]]


def test_a_file_that_is_not_a_store(run_dir: Path, tmp_path: Path) -> None:
    text = tmp_path / "notes.h5"
    text.write_text("not HDF5\n")
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = [1, 2, 3]
    newer = tmp_path / "newer.h5"
    shutil.copy(run_dir / "trajectories.h5", newer)
    with h5py.File(newer, "r+") as f:
        f.attrs["sfhpc_schema"] = SCHEMA_VERSION + 1
    for path, message in ((text, "is not an HDF5 file"), (other, "not an sfhpc trajectory store"),
                          (newer, f"was written by a newer sfhpc (store schema {SCHEMA_VERSION + 1}"),
                          (tmp_path, "no trajectories.h5"),
                          (tmp_path / "nope", "no such file or folder")):
        before = _digest(path) if path.is_file() else None
        for args in _reads(path, tmp_path):
            assert_one_line_error(_cli("traj", *args), message)
        assert before is None or _digest(path) == before
    assert not [p for p in tmp_path.iterdir() if p.suffix in (".png", ".html", ".csv", ".parquet")]
    assert_one_line_error(run_sfhpc("traj", "report", str(newer)), "newer sfhpc")  # as a user's shell runs it
    assert_one_line_error(_cli("traj", "summary", str(run_dir), "--follow", "--interval", "0"), "--interval")


def test_unknown_id_and_existing_outputs_leave_everything_as_it_was(run_dir: Path, tmp_path: Path) -> None:
    store = run_dir / "trajectories.h5"
    before = _digest(store)
    assert_one_line_error(run_sfhpc("traj", "show", str(run_dir), "no-such-id"), "no trajectory with id 'no-such-id'")
    for args in _reads(run_dir, tmp_path)[1:5]:  # the commands that write a file, to files that exist
        out = Path(args[-1])
        out.write_text("mine")
        assert_one_line_error(_cli("traj", *args), "exists")
        assert out.read_text() == "mine"
    (tmp_path / "fresh").mkdir()
    for args in _reads(run_dir, tmp_path / "fresh"):
        done = _cli("traj", *args)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (args, done.stderr)
    assert _digest(store) == before and not (run_dir / "trajectories.png").exists()


def test_an_empty_store_gives_empty_valid_results(tmp_path: Path) -> None:
    run = tmp_path / "empty"
    run.mkdir()
    TrajectoryStore.create(run / "trajectories.h5").close()
    before = _digest(run / "trajectories.h5")
    summary = _cli("traj", "summary", str(run))
    assert summary.returncode == 0 and ["trajectories", "0"] in [line.split() for line in summary.stdout.splitlines()]
    assert "partial rollouts: 0 trajectories" in summary.stdout
    out = tmp_path / "t.parquet"
    done = _cli("traj", "export", str(run), "--format", "parquet", "--out", str(out))
    assert done.returncode == 0 and "wrote 0 trajectories" in done.stdout, done.stderr
    df = pd.read_parquet(out)
    assert len(df) == 0 and "staleness" in df.columns and str(df["staleness"].dtype) == "Int64"
    compare = _cli("traj", "compare", str(run), str(run))
    assert compare.returncode == 0 and "not recorded" in compare.stdout, compare.stderr
    assert_one_line_error(_cli("traj", "plot", str(run)), "nothing to plot")
    assert _digest(run / "trajectories.h5") == before
