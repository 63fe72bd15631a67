"""``guess-number``: a multi-turn agentic task with a long-tailed number of turns.

The environment holds a secret digit. Each turn the agent replies with a guess; the environment
answers ``higher``, ``lower`` or ends the episode when the guess is right. An episode lasts until the
secret is found or `max_turns` replies were made, so the number of turns depends on the policy: a
random guesser needs many, one that follows the hints needs few. Reward: 1 for finding the secret,
minus `turn_cost` for every reply after the first; 0 when it is never found.

Each reply also has a reward of its own (`StepResult.turn_reward`, trained on with ``credit: turn`` and
``turn_reward_weight``): 1 for a guess the hints so far allow (the secret may be that digit), 0 for any
other reply. The episode's reward alone says little about one guess of eight; this one says which guesses
used what the hints told.
"""

from __future__ import annotations

import random

from sfhpc.tasks.base import Episode, Problem, StepResult, Task


class _GuessEpisode(Episode):
    def __init__(self, secret: int, max_turns: int, turn_cost: float) -> None:
        self.secret, self.max_turns, self.turn_cost = secret, max_turns, turn_cost
        self.turns = 0
        self.low, self.high = 0, 9  # the digits the hints so far allow

    def opening(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": "guess 0-9"}]

    def step(self, reply: str) -> StepResult:
        self.turns += 1
        text = reply.strip()
        # ASCII digits only: str.isdigit() also accepts '²' and other Unicode digits, which int() refuses
        # (or reads as another digit), and a policy writes them sooner or later.
        guess = int(text) if text.isascii() and text.isdigit() else None
        allowed = 1.0 if guess is not None and self.low <= guess <= self.high else 0.0
        if guess == self.secret:
            return StepResult(done=True, reward=max(0.0, 1.0 - self.turn_cost * (self.turns - 1)), turn_reward=1.0)
        if self.turns >= self.max_turns:
            return StepResult(done=True, reward=0.0, turn_reward=allowed)
        if guess is None:
            return StepResult(done=False, observation="?", turn_reward=0.0)
        higher = guess < self.secret
        if higher:
            self.low = max(self.low, guess + 1)
        else:
            self.high = min(self.high, guess - 1)
        return StepResult(done=False, observation="higher" if higher else "lower", turn_reward=allowed)


class GuessNumberTask(Task):
    name = "guess-number"
    max_reply_tokens = 3

    def __init__(self, max_turns: int = 8, turn_cost: float = 0.1) -> None:
        if max_turns < 1:
            raise TypeError("max_turns must be at least 1")
        self.max_turns, self.turn_cost = max_turns, turn_cost

    def sample(self, rng: random.Random) -> Problem:
        secret = rng.randrange(10)
        return Problem(key=str(secret), data=secret)

    def episode(self, problem: Problem) -> Episode:
        return _GuessEpisode(problem.data, self.max_turns, self.turn_cost)

    def warm_start_examples(self, rng: random.Random, count: int) -> list[list[dict[str, str]]]:
        # Format only: random single-digit guesses, whatever the hints say.
        examples = []
        for _ in range(count):
            conversation = [{"role": "user", "content": "guess 0-9"}]
            for _ in range(rng.randrange(1, 4)):
                conversation.append({"role": "assistant", "content": str(rng.randrange(10))})
                conversation.append({"role": "user", "content": rng.choice(["higher", "lower"])})
            examples.append(conversation[:-1])
        return examples
