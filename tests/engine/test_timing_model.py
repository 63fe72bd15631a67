"""The timing models of the pipeline benchmark: the test engine paced by a cost model (decode steps that
grow with the batch, prefill, weight loads; replies to the length bound) and the ``timing`` trainer
backend (a modelled step, a real all-reduce and the policy version a real trainer would give)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from sfhpc.config import load_recipe
from sfhpc.engine.base import GenerationRequest
from sfhpc.engine.factory import start_engine
from sfhpc.engine.scripted import ScriptedEngine
from sfhpc.engine.tokenizer import BYTE_MARKER_KEY, END, MODEL_MARKER
from sfhpc.errors import ConfigError
from sfhpc.trainer.batch import TrainBatch, TrainRow
from sfhpc.trainer.timing_trainer import WEIGHT_NAME, TimingTrainer

LETTERS = tuple(range(ord("a"), ord("z") + 1))


async def _generate(engine: ScriptedEngine, rid: str, prompt: int, tokens: int) -> float:
    started = time.perf_counter()
    async for _ in engine.generate(GenerationRequest(rid, tuple(range(prompt)), tokens, seed=1)):
        pass
    return time.perf_counter() - started


def test_a_decode_step_grows_with_the_sequences_in_flight() -> None:
    engine = ScriptedEngine(vocab=LETTERS, token_delay=0.004, per_sequence_delay=0.002)

    async def alone_then_eight() -> tuple[float, float]:
        alone = await _generate(engine, "solo", 1, 20)
        batch = await asyncio.gather(*(_generate(engine, f"r{i}", 1, 20) for i in range(8)))
        return alone, max(batch)

    alone, eight = asyncio.run(alone_then_eight())
    # 20 steps of 4 + 1 x 2 ms alone; of 4 + 8 x 2 ms with eight in flight: throughput grows, steps lengthen.
    # (Sleeps make the lower bounds exact; the upper ones leave room for a busy machine.)
    assert 0.12 <= alone < 0.5
    assert 0.4 <= eight < 1.2
    assert 8 * 20 / eight > 20 / alone


def test_prefill_and_weight_loads_take_their_modelled_time() -> None:
    engine = ScriptedEngine(vocab=LETTERS, prefill_delay=0.002, load_delay=0.2)

    async def run() -> tuple[float, float, float]:
        short = await _generate(engine, "short", 5, 1)
        long = await _generate(engine, "long", 100, 1)
        await engine.pause()
        started = time.perf_counter()
        await engine.load_weights([("seed", 7)])
        return short, long, time.perf_counter() - started

    short, long, load = asyncio.run(run())
    assert short < 0.15 and 0.2 <= long < 0.5
    assert 0.2 <= load < 0.5 and engine.version == 1


def _recipe(tmp_path: Path, engine: str, training: str = "{backend: torch}", timing: str = "{}") -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(f"name: t\nengine: {engine}\ntraining: {training}\ntiming_model: {timing}\n"
                    "task: {name: repeat-letter}\n"
                    "roles:\n  controller: {place_with: trainer}\n  trainer: {tags: [train]}\n"
                    "  rollout: {tags: [rollout]}\n")
    return path


def test_an_engine_that_writes_to_budget_never_ends_a_reply_itself(tmp_path: Path) -> None:
    # A policy folder of the byte-level kind: the engine writes that tokenizer's letters (and end of turn).
    (tmp_path / MODEL_MARKER).write_text(json.dumps({BYTE_MARKER_KEY: "byte"}))
    timing = load_recipe(_recipe(tmp_path, "{name: test, token_delay_s: 0.001, writes_to_budget: true}",
                                 timing="{per_sequence_s: 0.0001}"))
    engine = start_engine(timing, tmp_path, rank=3)
    assert isinstance(engine, ScriptedEngine) and END not in engine.vocab
    assert (engine.token_delay, engine.per_sequence_delay) == (0.001, 0.0001)
    plain = start_engine(load_recipe(_recipe(tmp_path, "{name: test}")), tmp_path, rank=3)
    assert END in plain.vocab  # type: ignore[attr-defined]

    async def lengths(e: ScriptedEngine) -> list[int]:
        out = []
        for i in range(10):
            n = 0
            async for chunk in e.generate(GenerationRequest(f"q{i}", (1, 2, 3), 60, seed=i, stop_token_ids=(END,))):
                n += len(chunk.token_ids)
            out.append(n)
        return out

    assert asyncio.run(lengths(engine)) == [60] * 10
    assert min(asyncio.run(lengths(plain))) < 60  # type: ignore[arg-type]


@pytest.mark.parametrize(("engine", "training", "timing", "key"), [
    ("{name: vllm}", "{backend: torch}", "{per_sequence_s: 0.1}", "timing_model.per_sequence_s"),
    ("{name: vllm, writes_to_budget: true}", "{backend: torch}", "{}", "writes_to_budget"),
    ("{name: test}", "{backend: torch}", "{weight_load_s: -1}", "timing_model.weight_load_s"),
    ("{name: test}", "{backend: torch}", "{train_per_token_s: 0.1}", "timing_model.train_per_token_s"),
    ("{name: test}", "{backend: timing}", "{train_step_s: -0.5}", "timing_model.train_step_s"),
])
def test_timing_settings_where_they_do_not_belong_are_refused(tmp_path: Path, engine: str, training: str,
                                                              timing: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        load_recipe(_recipe(tmp_path, engine, training, timing))


@pytest.mark.parametrize(("section", "old", "new"), [
    ("engine", "{name: test, per_sequence_s: 0.1}", "timing_model.per_sequence_s"),
    ("training", "{backend: timing, timing_step_s: 1}", "timing_model.train_step_s"),
])
def test_the_old_places_of_the_timing_knobs_say_where_they_went(tmp_path: Path, section: str, old: str,
                                                                 new: str) -> None:
    engine, training = (old, "{backend: torch}") if section == "engine" else ("{name: test}", old)
    with pytest.raises(ConfigError, match=f"renamed to '{new}'"):
        load_recipe(_recipe(tmp_path, engine, training))


def _batch(versions: list[int], length: int = 10) -> TrainBatch:
    rows = [TrainRow(tokens=list(range(length)), generated=[False] * 4 + [True] * (length - 4),
                     logprobs=[0.0] * length, versions=[-1] * 4 + [v] * (length - 4), reward=float(i % 2),
                     group=i // 2) for i, v in enumerate(versions)]
    return TrainBatch.from_rows(rows)


def test_the_timing_trainer_sleeps_its_modelled_step_and_moves_the_version(tmp_path: Path) -> None:
    trainer = TimingTrainer(None, step_s=0.05, per_token_s=0.005)
    batch = _batch([0, 0, 0, 0])
    assert trainer.modelled_seconds(batch) == pytest.approx(0.05 + 0.005 * 40)
    started = time.perf_counter()
    first = trainer.train_step(batch)
    assert 0.25 <= time.perf_counter() - started < 0.75
    assert (first.policy_version, first.max_staleness, first.tokens, first.sequences) == (1, 0, 24, 4)
    assert first.reward_mean == 0.5
    second = trainer.train_step(_batch([0, 1, 1, 1]))  # trained at version 1: one row a version behind
    assert (second.policy_version, second.max_staleness) == (2, 1)
    assert second.mean_staleness == pytest.approx(0.25)
    [(name, weights)] = list(trainer.named_weights())
    assert name == WEIGHT_NAME and float(weights[0]) == 2.0  # engines that hash weights see a new version
    trainer.save_checkpoint(tmp_path / "trainer.json")
    again = TimingTrainer(None, step_s=0.0, per_token_s=0.0)
    again.load_checkpoint(tmp_path / "trainer.json")
    assert (again.step, again.policy_version) == (2, 2)
