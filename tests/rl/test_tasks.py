"""Tasks judge replies by their text: verifiable rewards, multi-turn hints, format-only warm-start data."""

from __future__ import annotations

import random

import pytest

from sfhpc.config.recipe import TaskSpec
from sfhpc.engine.tokenizer import ASSISTANT, END, ByteTokenizer
from sfhpc.errors import ConfigError
from sfhpc.model.warm_start import encode_with_targets
from sfhpc.tasks import get_task
from sfhpc.tasks.base import Problem


def test_next_letter_rewards_exactly_the_next_letter() -> None:
    task = get_task(TaskSpec("next-letter", {"letters": "cx"}))
    problems = {task.sample(random.Random(s)).key for s in range(20)}
    assert problems == {"c", "x"}
    episode = task.episode(task.sample(random.Random(0)))
    letter = episode.opening()[0]["content"].split()[-1]
    right = chr(ord(letter) + 1)
    assert episode.step(right).reward == 1.0 and episode.step(right).done
    assert task.episode(task.sample(random.Random(0))).step(right + right).reward == 0.0
    assert task.episode(task.sample(random.Random(0))).step(letter).reward == 0.0


def test_guess_number_answers_with_hints_and_ends() -> None:
    task = get_task(TaskSpec("guess-number", {"max_turns": 4, "turn_cost": 0.25}))
    episode = task.episode(task.sample(random.Random(1)))
    secret = episode.secret  # type: ignore[attr-defined]
    below = episode.step(str(max(0, secret - 1)) if secret else "5")
    if secret:
        assert (below.done, below.observation) == (False, "higher")
    assert episode.step("x").observation == "?"
    hit = episode.step(str(secret))
    assert hit.done and hit.reward == pytest.approx(1.0 - 0.25 * (episode.turns - 1))  # type: ignore[attr-defined]
    never = task.episode(task.sample(random.Random(1)))
    results = [never.step("nope") for _ in range(4)]
    assert [r.done for r in results] == [False, False, False, True] and results[-1].reward == 0.0


def test_guess_number_rewards_each_guess_the_hints_allow() -> None:
    task = get_task(TaskSpec("guess-number", {"max_turns": 8}))
    episode = task.episode(Problem(key="6", data=6))
    # 3 (allowed: higher), 2 (below 3: not allowed), 8 (allowed: lower), 9 (above 8: no), "x" (no), 7, 6
    results = [episode.step(reply) for reply in ("3", "2", "8", "9", "x", "7", "6")]
    assert [r.turn_reward for r in results] == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert results[-1].done and results[-1].reward == pytest.approx(0.4)


@pytest.mark.parametrize("reply", ["²", "٣", "3²", "¹⁰"])
def test_guess_number_reads_only_ascii_digits(reply: str) -> None:
    # A policy wrote '²' at step 43 of a run: str.isdigit() accepted it and int() raised inside the task.
    # '٣' (Arabic-Indic three) is worse: int() reads it as 3, a guess the agent never wrote in the format.
    task = get_task(TaskSpec("guess-number", {"max_turns": 3}))
    episode = task.episode(task.sample(random.Random(0)))
    result = episode.step(reply)
    assert (result.done, result.observation) == (False, "?")


def test_unknown_task_and_bad_options() -> None:
    with pytest.raises(ConfigError, match="unknown task 'chess'"):
        get_task(TaskSpec("chess"))
    with pytest.raises(ConfigError, match="bad options for task 'next-letter'"):
        get_task(TaskSpec("next-letter", {"letters": "z"}))


def test_warm_start_targets_are_the_assistant_replies_only() -> None:
    task = get_task(TaskSpec("next-letter"))
    conversation = task.warm_start_examples(random.Random(0), 1)[0]
    ids, targets = encode_with_targets(conversation, ByteTokenizer())
    reply = [t for t, is_target in zip(ids, targets) if is_target]
    assert reply == [*conversation[1]["content"].encode(), END]
    assert ids[ids.index(ASSISTANT) + 1] == reply[0]


def test_run_refuses_what_this_version_cannot_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.conftest import RECIPES, assert_one_line_error, run_sfhpc

    recipe = tmp_path / "unknown-task.yaml"
    recipe.write_text((RECIPES / "demo.yaml").read_text().replace("next-letter", "next-word")
                      + f"output_dir: {tmp_path / 'runs'}\n")
    assert_one_line_error(run_sfhpc("run", str(recipe)), "unknown task 'next-word'")
    assert not (tmp_path / "runs").exists()
