"""``sfhpc traj show`` and ``sfhpc traj export --format parquet|jsonl|csv`` as a user runs them."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pandas as pd
import pytest

from sfhpc.analysis import TRAJECTORY_COLUMNS, open_run
from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.store import TrajectoryStore
from tests.analysis.runs import IDS, write_run
from tests.conftest import assert_one_line_error, run_sfhpc


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_run(tmp_path_factory.mktemp("cli") / "run")


def test_show_an_interrupted_reply_names_both_versions_and_the_cut(run_dir: Path) -> None:
    done = run_sfhpc("traj", "show", str(run_dir), "cut")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "status consumed" in out and "trained at step 0 by version 2, staleness 1" in out
    assert "<|user|>What is 2+3?" in out and "    The ans\n" in out and "    wer is 5<|end|>" in out
    assert "written by 2 versions: 1, 2" in out
    assert "version 1  engine rollout-0  7 tokens  finish abort" in out
    assert "version 2  engine rollout-1  9 tokens  finish stop  continues [1] after its cut" in out
    assert "cut here" in out and "continued by [2]" in out


def test_show_a_multi_turn_trajectory_with_tokens(run_dir: Path) -> None:
    done = run_sfhpc("traj", "show", str(run_dir / "trajectories.h5"), "multi", "--tokens")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    headers = [line for line in lines if line.startswith("[")]
    assert [h.split("  ")[0] for h in headers] == ["[0] prompt", "[1] assistant (reply 1)", "[2] user observation",
                                                     "[3] assistant (reply 2)"]
    assert "    Wrong, try again.<|end|><|assistant|>" in "\n".join(lines).replace("<|user|>", "")
    # The last reply's tokens: '5' (id 53) then <|end|> (259), each with its logprob and version.
    rows = [line.split() for line in lines if line.startswith("    ") and line.split()[:1] in (["0"], ["1"])]
    assert ["0", "53", "'5'", "-0.3000", "2"] in rows and ["1", "259", "'<|end|>'", "-0.1000", "2"] in rows
    assert ["0", "257", "'<|bos|>'", "-", "-"] in rows


def test_show_errors_are_one_line(run_dir: Path, tmp_path: Path) -> None:
    assert_one_line_error(run_sfhpc("traj", "show", str(run_dir), "no-such-id"), "no trajectory with id 'no-such-id'")
    assert_one_line_error(run_sfhpc("traj", "show", str(tmp_path), "cut"), "no trajectories.h5")
    (tmp_path / "x.h5").write_text("not hdf5")
    assert_one_line_error(run_sfhpc("traj", "show", str(tmp_path / "x.h5"), "cut"), "not an HDF5 file")


def test_parquet_and_jsonl_read_back_to_the_same_rows_and_types(run_dir: Path, tmp_path: Path) -> None:
    with open_run(run_dir) as run:
        expected = run.trajectories()
    parquet, jsonl = tmp_path / "t.parquet", tmp_path / "t.jsonl"
    done = run_sfhpc("traj", "export", str(run_dir), "--format", "parquet", "--out", str(parquet))
    assert done.returncode == 0 and "wrote 5 trajectories" in done.stdout, done.stderr
    back = pd.read_parquet(parquet)
    assert list(back["id"]) == IDS
    assert dict(back.dtypes) == dict(expected.dtypes)
    pd.testing.assert_frame_equal(back, expected)

    assert run_sfhpc("traj", "export", str(run_dir), "--format", "jsonl", "--out", str(jsonl)).returncode == 0
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["id"] for r in records] == IDS and list(records[0]) == list(expected.columns)
    cut = records[1]
    assert (cut["versions"], cut["interruptions"], cut["staleness"], cut["reward"]) == (2, 1, 1, 0.5)
    assert records[3]["reward"] is None and records[3]["fail_reason"] == "ValueError: not a digit"
    assert records[0]["created"] == expected["created"].iloc[0]  # full precision, not rounded


def test_csv_keeps_todays_columns(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.csv"
    assert run_sfhpc("traj", "export", str(run_dir), "--out", str(out)).returncode == 0
    with out.open(encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
        assert tuple(reader.fieldnames or ()) == TRAJECTORY_COLUMNS
    assert [r["id"] for r in rows] == IDS and rows[1]["staleness"] == "1"


def test_export_never_overwrites_and_an_empty_store_exports_empty(run_dir: Path, tmp_path: Path) -> None:
    mine = tmp_path / "mine.parquet"
    mine.write_bytes(b"the user's own data")
    assert_one_line_error(run_sfhpc("traj", "export", str(run_dir), "--format", "parquet", "--out", str(mine)),
                          "exists")
    assert mine.read_bytes() == b"the user's own data"
    missing = tmp_path / "nothing.parquet"
    assert_one_line_error(run_sfhpc("traj", "export", str(tmp_path), "--format", "parquet", "--out", str(missing)),
                          "no trajectories.h5")
    assert not missing.exists()

    empty = write_empty(tmp_path / "empty")
    out = tmp_path / "empty.parquet"
    done = run_sfhpc("traj", "export", str(empty), "--format", "parquet", "--out", str(out))
    assert done.returncode == 0 and "wrote 0 trajectories" in done.stdout, done.stderr
    back = pd.read_parquet(out)
    assert back.empty and str(back["staleness"].dtype) == "Int64" and "interruptions" in back.columns


def write_empty(folder: Path) -> Path:
    folder.mkdir()
    TrajectoryManager(TrajectoryStore.create(folder / "trajectories.h5")).close()
    return folder
