"""``next-letter``: a single-turn task with a verifiable reward.

The user asks for the letter that follows a given lowercase letter; the reply is right when it is exactly
that letter. A random policy that has learned the reply format (one letter) is right 1 time in 25, so a
rising success rate is learning, not luck.
"""

from __future__ import annotations

import random
import string

from sfhpc.tasks.base import Episode, Problem, StepResult, Task

LETTERS = string.ascii_lowercase[:-1]  # 'z' has no next letter


class _NextLetterEpisode(Episode):
    def __init__(self, letter: str) -> None:
        self.letter = letter

    def opening(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"after {self.letter}"}]

    def step(self, reply: str) -> StepResult:
        expected = chr(ord(self.letter) + 1)
        return StepResult(done=True, reward=1.0 if reply.strip() == expected else 0.0)


class NextLetterTask(Task):
    """Options: ``letters``, the letters questions are drawn from (default a-y; fewer letters learn faster)."""

    name = "next-letter"
    max_turns = 1
    max_reply_tokens = 3

    def __init__(self, letters: str = LETTERS) -> None:
        if not letters or any(c not in LETTERS for c in letters):
            raise TypeError(f"letters must be a non-empty string of letters from {LETTERS!r}")
        self.letters = letters

    def sample(self, rng: random.Random) -> Problem:
        letter = rng.choice(self.letters)
        return Problem(key=letter, data=letter)

    def episode(self, problem: Problem) -> Episode:
        return _NextLetterEpisode(problem.data)

    def warm_start_examples(self, rng: random.Random, count: int) -> list[list[dict[str, str]]]:
        # Format only: the reply is *some* letter, not the right one.
        return [[{"role": "user", "content": f"after {rng.choice(self.letters)}"},
                 {"role": "assistant", "content": rng.choice(string.ascii_lowercase)}] for _ in range(count)]
