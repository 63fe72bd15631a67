"""``sfhpc traj summary|export`` on a store written by the real trajectory manager."""

from __future__ import annotations

import csv
from pathlib import Path

from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.store import TrajectoryStore
from tests.conftest import assert_one_line_error, run_sfhpc


def _run_folder(tmp_path: Path) -> Path:
    """Two groups trained at steps 0 and 1 (one of them partly stale), one trajectory still running."""
    run = tmp_path / "run"
    run.mkdir()
    manager = TrajectoryManager(TrajectoryStore.create(run / "trajectories.h5"), max_token_lag=1)
    # Each group is trained by the policy version after its newest token (no token is newer than its policy).
    for name, versions, policy in (("a", (2, 2), 2), ("b", (2, 3), 3)):
        for j in range(2):
            tid = manager.start([1, 2, 3], task="t", group=name, trajectory_id=f"{name}-{j}")
            manager.add_generated(tid, [4, 5], [-0.1, -0.2], versions[j])
            manager.observe(tid, [1, 2, 3, 4, 5, 6])  # an environment answer, then a second reply
            manager.add_generated(tid, [7], [-0.3], versions[j])
            manager.finish(tid, reward=float(j), turn_rewards=[0.0, float(j)])
        assert manager.take_batch(policy_version=policy, num_groups=1, group_size=2) is not None
    manager.start([9], task="t", group="c", trajectory_id="c-0")
    manager.close()
    return run


def test_summary_and_export_report_what_the_manager_recorded(tmp_path: Path) -> None:
    run = _run_folder(tmp_path)
    summary = run_sfhpc("traj", "summary", str(run))
    assert summary.returncode == 0, summary.stderr
    lines = dict(line.split(None, 1) if " " in line.strip() else (line.strip(), "")
                 for line in summary.stdout.splitlines() if line.strip())
    assert lines["trajectories"].strip() == "5" and lines["consumed"].strip() == "4"
    assert lines["running"].strip() == "1"

    out = tmp_path / "t.csv"
    done = run_sfhpc("traj", "export", str(run / "trajectories.h5"), "--out", str(out))
    assert done.returncode == 0 and "wrote 5 trajectories" in done.stdout, done.stderr
    rows = {r["id"]: r for r in csv.DictReader(out.open())}
    assert list(rows) == ["a-0", "a-1", "b-0", "b-1", "c-0"]
    expected = {"status": "consumed", "reward": "1.0", "turns": "2", "tokens": "7", "generated_tokens": "3",
                "consumed_step": "0", "trained_version": "2", "staleness": "0"}
    assert {k: rows["a-1"][k] for k in expected} == expected
    # b-0 was sampled by version 2 and trained on at version 3: one version stale.
    assert (rows["b-0"]["min_version"], rows["b-0"]["trained_version"], rows["b-0"]["staleness"]) == ("2", "3", "1")
    assert (rows["b-1"]["consumed_step"], rows["b-1"]["staleness"]) == ("1", "0")
    assert rows["c-0"]["status"] == "running" and rows["c-0"]["consumed_step"] == "" and rows["c-0"]["reward"] == ""


def test_export_never_overwrites_and_bad_paths_get_one_line(tmp_path: Path) -> None:
    run = _run_folder(tmp_path)
    out = tmp_path / "mine.csv"
    out.write_text("the user's own data\n")
    assert_one_line_error(run_sfhpc("traj", "export", str(run), "--out", str(out)), "exists")
    assert out.read_text() == "the user's own data\n"
    assert_one_line_error(run_sfhpc("traj", "summary", str(tmp_path / "nope")), "no such file or folder")
    assert_one_line_error(run_sfhpc("traj", "summary", str(tmp_path)), "no trajectories.h5")


def test_plot_draws_beside_the_store_and_keeps_existing_files(tmp_path: Path) -> None:
    run = _run_folder(tmp_path)
    done = run_sfhpc("traj", "plot", str(run))
    assert done.returncode == 0, done.stderr
    png = run / "trajectories.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    before = png.read_bytes()
    assert_one_line_error(run_sfhpc("traj", "plot", str(run)), "exists")
    assert png.read_bytes() == before
    empty = tmp_path / "empty"
    empty.mkdir()
    TrajectoryManager(TrajectoryStore.create(empty / "trajectories.h5")).close()
    assert_one_line_error(run_sfhpc("traj", "plot", str(empty)), "nothing to plot")
    assert not (empty / "trajectories.png").exists()
