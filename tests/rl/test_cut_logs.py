"""A run whose ``metrics.jsonl`` ends in a line a crash cut (a full disk) is resumed from it: the cut text is set
aside beside the log, with a warning naming the file and the line, and the lines appended after it stand on
their own. A whole run with cut logs, read by the analysis and resumed, is `test_crash_resume.py`'s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sfhpc.rl.progress import Progress


def cut_last_line(path: Path) -> tuple[int, bytes]:
    """Cut the last line of `path` in its middle, as a write stopped by a full disk leaves it; returns its
    line number and the bytes left of it."""
    lines = path.read_bytes().split(b"\n")[:-1]
    kept = lines[-1][:len(lines[-1]) // 2]
    path.write_bytes(b"".join(line + b"\n" for line in lines[:-1]) + kept)
    return len(lines), kept


def row(step: int) -> dict[str, float | int]:
    return {"step": step, "reward_mean": step / 10, "generated_tokens_per_s": 1.0, "trained_tokens_per_s": 1.0,
            "sync_s": 0.0, "generated_tokens": 1, "trained_tokens": 1}


def test_progress_resumes_from_metrics_with_a_cut_last_row(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    first = Progress(tmp_path, total_steps=4)
    for step in (1, 2, 3):
        first.step(row(step))
    assert first.events is not None
    first.events.close()
    line, kept = cut_last_line(tmp_path / "metrics.jsonl")
    resumed = Progress(tmp_path, total_steps=4)  # what the controller builds on a restart
    resumed.resume(2)  # the checkpoint of step 2; step 3's row was being written when the disk filled
    assert f"metrics.jsonl: line {line} was cut" in capsys.readouterr().err
    assert [r["step"] for r in resumed.rows] == [1, 2]
    assert (tmp_path / "metrics.jsonl.damaged").read_bytes() == kept + b"\n"
    resumed.step(row(3))
    rows = [json.loads(text) for text in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["reward_mean"] == 0.3
