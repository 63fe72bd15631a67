"""A run whose ``metrics.jsonl`` and ``events.jsonl`` end in a line a crash cut (a full disk): the analysis
reads it and ``sfhpc run --resume`` continues it, each with a warning naming the file and the line; the cut
text is set aside beside the log, and the lines appended after it stand on their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sfhpc.rl.progress import Progress
from tests.conftest import run_sfhpc

RECIPE = """\
name: cutlog
seed: 3
engine: {{name: test}}
algorithm: {{group_size: 2}}
pipeline: {{mode: sync}}
budgets: {{steps: {steps}, prompts_per_step: 2, max_new_tokens: 16}}
task: {{name: next-letter}}
model: {{path: {model}}}
roles:
  controller: {{place_with: trainer}}
  trainer:    {{tags: [train, rollout], nodes: 1}}
  rollout:    {{colocate_with: trainer}}
"""


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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer policy folder, built once (a run would build a larger one itself)."""
    from sfhpc.config.recipe import ModelSpec
    from sfhpc.model.tiny import build_tiny_model
    from sfhpc.tasks.letters import NextLetterTask

    return build_tiny_model(ModelSpec(layers=1, hidden_size=64, heads=1), tmp_path_factory.mktemp("model") / "tiny",
                            seed=3, task=NextLetterTask())


@pytest.mark.mpi
def test_a_run_with_cut_logs_is_read_by_the_analysis_and_resumed(tmp_path: Path, model_dir: Path) -> None:
    recipe = tmp_path / "cutlog.yaml"
    recipe.write_text(RECIPE.format(steps=2, model=model_dir) + f"output_dir: {tmp_path / 'runs'}\n")
    done = run_sfhpc("run", str(recipe), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    metrics_line, metrics_kept = cut_last_line(run_dir / "metrics.jsonl")
    events_line, events_kept = cut_last_line(run_dir / "events.jsonl")

    report = run_sfhpc("traj", "report", str(run_dir))
    assert report.returncode == 0, report.stderr
    assert f"sfhpc: warning: {run_dir / 'metrics.jsonl'}: line {metrics_line} is cut" in report.stderr
    assert (run_dir / "report.html").stat().st_size > 1000
    assert not (run_dir / "metrics.jsonl.damaged").exists()  # a reader leaves the run folder as it is

    recipe.write_text(RECIPE.format(steps=3, model=model_dir) + f"output_dir: {tmp_path / 'runs'}\n")  # a step more
    done = run_sfhpc("run", str(recipe), "--resume", str(run_dir), timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert f"{run_dir / 'metrics.jsonl'}: line {metrics_line} was cut" in out
    assert f"{run_dir / 'events.jsonl'}: line {events_line} was cut" in out
    assert (run_dir / "metrics.jsonl.damaged").read_bytes() == metrics_kept + b"\n"
    assert (run_dir / "events.jsonl.damaged").read_bytes() == events_kept + b"\n"
    rows = [json.loads(text) for text in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 3]  # step 2's row is the one set aside; step 3 trained after it
    events = [json.loads(text) for text in (run_dir / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "finished" and events[-1]["step"] == 3
    assert any(e["event"] == "resumed" and e["step"] == 2 for e in events)
