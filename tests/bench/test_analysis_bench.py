"""``sfhpc bench analysis`` at a tiny size: it builds its store, runs the three commands and reports every
figure (the full size, a million trajectories, is `make bench`)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_sfhpc


def test_analysis_bench_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "analysis.json"
    done = run_sfhpc("bench", "analysis", "--trajectories", "2000", "--out", str(out), "--dir", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["store"]["trajectories"] == 2000 and result["store"]["tokens"] == 2000 * 100
    assert result["store"]["steps"] == 2000 // 64 - 1  # a step per 64 trajectories; the last batch untrained
    for name in ("summary", "export_parquet", "plot"):
        figures = result["commands"][name]
        assert figures["exit_code"] == 0 and 0 < figures["seconds"] < 60 and 0.01 < figures["peak_gib"] < 4, name
        assert 0 < figures["cpu_seconds"] < 120, name
    assert set(result["met"]) == {"summary_s", "summary_peak_gib", "export_parquet_s", "plot_s"}
    assert all(result["met"].values()) and result["parquet_mb"] > 0
    for line in ("store: 2,000 trajectories, 200,000 tokens", "summary", "export --format parquet", "plot",
                 "targets: summary < 30 s"):
        assert line in done.stdout, done.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["analysis.json"]  # its store and outputs were removed
