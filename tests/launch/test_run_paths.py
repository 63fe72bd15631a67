"""The run folder's layout as a user sees it: every name `RunPaths` gives, spelled out."""

from __future__ import annotations

from pathlib import Path

from sfhpc.data.run_log import repair_log
from sfhpc.rundir import RunPaths


def test_run_paths_name_the_documented_layout() -> None:
    paths = RunPaths(Path("/runs/demo-20250101-000000"))
    names = {
        "trajectories.h5": paths.store, "events.jsonl": paths.events, "metrics.jsonl": paths.metrics,
        "metrics-discarded.jsonl": paths.metrics_discarded, "status.json": paths.status,
        "launch_report.json": paths.launch_report, "model": paths.model, "checkpoints": paths.checkpoints,
        "logs": paths.logs, "reward.png": paths.reward_plot, "submitit": paths.submitit,
        "slurm-42.out": paths.slurm_log("42"), "slurm-%j.out": paths.slurm_log_pattern,
        "logs/rank-007.log": paths.rank_log(7), "events.jsonl.damaged": paths.damaged(paths.events),
    }
    for name, path in names.items():
        assert path == paths.root / name


def test_a_cut_log_line_lands_where_run_paths_says(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    paths.events.write_text('{"event": "start"}\n{"event": "sto')
    repair_log(paths.events)
    assert paths.damaged(paths.events).read_text().strip() == '{"event": "sto'
    assert paths.events.read_text() == '{"event": "start"}\n'
