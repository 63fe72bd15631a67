"""A failed trajectory's reason reaches the export and the summary."""

from __future__ import annotations

import csv
from pathlib import Path

from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.store import TrajectoryStore
from tests.conftest import run_sfhpc


def test_export_and_summary_show_failures(tmp_path: Path) -> None:
    manager = TrajectoryManager(TrajectoryStore.create(tmp_path / "trajectories.h5"))
    manager.finish(manager.start([1], group="ok", trajectory_id="ok-0"), reward=1.0)
    manager.fail(manager.start([1], group="bad", trajectory_id="bad-0"), "ValueError: not a digit: '²'")
    manager.close()
    out = tmp_path / "t.csv"
    assert run_sfhpc("traj", "export", str(tmp_path), "--out", str(out)).returncode == 0
    rows = {r["id"]: r for r in csv.DictReader(out.open(encoding="utf-8"))}
    assert (rows["bad-0"]["status"], rows["bad-0"]["fail_reason"]) == ("failed", "ValueError: not a digit: '²'")
    assert rows["ok-0"]["fail_reason"] == ""
    summary = run_sfhpc("traj", "summary", str(tmp_path))
    assert summary.returncode == 0 and any(line.split()[:2] == ["failed", "1"] for line in summary.stdout.splitlines())
