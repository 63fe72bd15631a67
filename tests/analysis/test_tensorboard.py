"""The run's TensorBoard event file, read back by TensorBoard's own reader: the steps and values of
``metrics.jsonl``, and after a resume no step twice."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

from sfhpc.rl.progress import Progress
from sfhpc.rl.tfevents import crc32c, masked_crc


def _row(step: int, reward: float) -> dict[str, float | int]:
    return {"step": step, "version": step + 1, "reward_mean": reward, "generated_tokens_per_s": 100.0 + step,
            "trained_tokens_per_s": 50.5, "sync_s": 0.01 * step, "loss": -0.25 * step}


def _read(folder: Path) -> dict[str, list[tuple[int, float]]]:
    files = sorted(folder.glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    acc = EventAccumulator(str(files[0]), size_guidance={SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _assert_same(events: dict[str, list[tuple[int, float]]], metrics: list[dict]) -> None:
    for tag in ("version", "reward_mean", "generated_tokens_per_s", "trained_tokens_per_s", "sync_s", "loss",
                "elapsed_s"):
        steps = [step for step, _ in events[tag]]
        assert steps == [m["step"] for m in metrics], tag  # every step once, in order
        np.testing.assert_array_equal([v for _, v in events[tag]], np.float32([m[tag] for m in metrics]), tag)


def test_crc32c_is_castagnolis() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the check value of CRC-32C
    assert masked_crc(b"") == 0xA282EAD8


def test_steps_reach_tensorboard_as_in_metrics_jsonl(tmp_path: Path) -> None:
    progress = Progress(tmp_path, total_steps=5)
    for step in range(5):
        progress.step(_row(step, reward=step / 4))
    _assert_same(_read(tmp_path), _metrics(tmp_path))
    assert [v for _, v in _read(tmp_path)["reward_mean"]] == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_a_resumed_run_writes_no_step_twice(tmp_path: Path) -> None:
    first = Progress(tmp_path, total_steps=6)
    for step in range(5):
        first.step(_row(step, reward=0.1))
    first.events.close()
    resumed = Progress(tmp_path, total_steps=6)  # restored from the checkpoint of step 2: 3 and 4 train again
    resumed.resume(2)
    for step in range(3, 6):
        resumed.step(_row(step, reward=0.9))
    metrics = _metrics(tmp_path)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4, 5]
    events = _read(tmp_path)
    _assert_same(events, metrics)
    assert [v for _, v in events["reward_mean"]] == np.float32([0.1, 0.1, 0.1, 0.9, 0.9, 0.9]).tolist()
