"""``repeat-letter``: a single-turn task whose reply lengths are long-tailed, and the distribution behind it.

The user asks for one letter written N times (``write 7 x``); the right reply is exactly ``xxxxxxx``. N is
drawn from a discrete Pareto distribution (`long_tail_count`): most problems ask for a few letters, a few
ask for very many, so the replies of one training batch differ in length by orders of magnitude. That is
the workload that leaves a synchronous pipeline waiting: the whole step waits for its longest reply while
the ranks that wrote short ones sit idle.

Reward (verifiable, from the text only): 0 unless the reply holds nothing but the asked letter, else
``max(0, 1 - |k - N| / N)`` for k letters, so a reply that is close in length earns partial credit and the
exact one earns 1. Each reply may hold N + `slack` tokens (`Episode.reply_tokens`): a model may overshoot a
little, and an engine that writes to its budget (the timing model of `sfhpc.engine.scripted`) writes
replies as long-tailed as the problems.
"""

from __future__ import annotations

import math
import random
import string
from typing import Any

from sfhpc.tasks.base import Episode, Problem, StepResult, Task


def long_tail_count(rng: random.Random, *, low: int, high: int, alpha: float) -> int:
    """An integer in [low, high] from a Pareto tail of index `alpha`: P(N >= n) ~ (low / n) ** alpha.

    Inverse-CDF sampling of the continuous Pareto with scale `low`, floored and capped at `high`. A small
    `alpha` (about 1) gives a heavy tail, where the largest of a batch dominates its total length.
    """
    u = rng.random()
    value = low * (1.0 - u) ** (-1.0 / alpha)
    return int(min(high, math.floor(value)))


def check_long_tail(low: int, high: int, alpha: float, what: str) -> None:
    """TypeError (the registry's one line for bad options) when the distribution's options do not fit."""
    if low < 1 or high < low:
        raise TypeError(f"{what}: need 1 <= min <= max, found min {low}, max {high}")
    if not alpha > 0:
        raise TypeError(f"{what}: alpha must be more than 0 (about 1: a heavy tail), found {alpha}")


class _RepeatEpisode(Episode):
    def __init__(self, letter: str, count: int, slack: int) -> None:
        self.letter, self.count, self.slack = letter, count, slack

    def opening(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"write {self.count} {self.letter}"}]

    def reply_tokens(self) -> int:
        return self.count + self.slack

    def step(self, reply: str) -> StepResult:
        return StepResult(done=True, reward=repeat_reward(reply, self.letter, self.count))


def repeat_reward(reply: str, letter: str, count: int) -> float:
    """1 for exactly `count` times `letter`; less the further the length is off; 0 for any other character."""
    text = reply.strip()
    if not text or set(text) != {letter}:
        return 0.0
    return max(0.0, 1.0 - abs(len(text) - count) / count)


class RepeatLetterTask(Task):
    """Options: ``min_count`` / ``max_count`` (the range of N), ``alpha`` (the tail index: smaller is
    heavier), ``letters`` (the letters asked for), ``slack`` (tokens a reply may hold beyond N)."""

    name = "repeat-letter"
    max_turns = 1

    def __init__(self, min_count: int = 1, max_count: int = 200, alpha: float = 1.0,
                 letters: str = string.ascii_lowercase, slack: int = 2) -> None:
        check_long_tail(min_count, max_count, alpha, "repeat-letter")
        if not letters or any(c not in string.ascii_lowercase for c in letters):
            raise TypeError("letters must be a non-empty string of lower-case letters")
        if slack < 1:
            raise TypeError(f"slack must be at least 1 (room for the end of the reply), found {slack}")
        self.min_count, self.max_count, self.alpha = min_count, max_count, alpha
        self.letters, self.slack = letters, slack
        self.max_reply_tokens = max_count + slack

    def sample(self, rng: random.Random) -> Problem:
        letter = rng.choice(self.letters)
        count = long_tail_count(rng, low=self.min_count, high=self.max_count, alpha=self.alpha)
        return Problem(key=f"{count}{letter}", data=(letter, count))

    def problem_from_json(self, value: list[Any]) -> tuple[Any, ...]:
        return tuple(value)

    def episode(self, problem: Problem) -> Episode:
        letter, count = problem.data
        return _RepeatEpisode(letter, count, self.slack)

    def warm_start_examples(self, rng: random.Random, count: int) -> list[list[dict[str, str]]]:
        # The format: a run of the asked letter whose length grows with the number asked (half to one and a
        # half times it), so the policy's replies are as long-tailed as the problems, but rarely the exact
        # count: reward still has to be learned.
        examples = []
        for _ in range(count):
            letter = rng.choice(self.letters)
            asked = long_tail_count(rng, low=self.min_count, high=self.max_count, alpha=self.alpha)
            written = max(1, round(asked * rng.uniform(0.5, 1.5)))
            examples.append([{"role": "user", "content": f"write {asked} {letter}"},
                             {"role": "assistant", "content": letter * written}])
        return examples
