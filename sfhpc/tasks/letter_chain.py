"""``letter-chain``: a multi-turn task whose number of turns is long-tailed.

An episode is a chain of K questions, asked one per turn: the environment names a letter, the agent
replies with the letter that follows it, and the environment names the next letter, until K questions
were asked. K is drawn per problem from the discrete Pareto tail of `sfhpc.tasks.long_tail` (most chains
are short, a few are very long) and does not depend on the replies, so the tail is the workload's own,
whatever the policy: a synchronous step waits for its longest chain.

Reward (verifiable): the fraction of the K replies that were exactly the right letter; each turn's own
reward is 1 or 0.
"""

from __future__ import annotations

import random
import string

from sfhpc.tasks.base import Episode, Problem, StepResult, Task
from sfhpc.tasks.long_tail import check_long_tail, long_tail_count

LETTERS = string.ascii_lowercase[:-1]  # 'z' has no next letter


class _ChainEpisode(Episode):
    def __init__(self, letters: str) -> None:
        self.letters = letters
        self.turn = 0
        self.right = 0

    def opening(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"after {self.letters[0]}"}]

    def reply_tokens(self) -> int:
        return 2  # one letter and the end of the reply

    def step(self, reply: str) -> StepResult:
        expected = chr(ord(self.letters[self.turn]) + 1)
        hit = 1.0 if reply.strip() == expected else 0.0
        self.right += int(hit)
        self.turn += 1
        if self.turn == len(self.letters):
            return StepResult(done=True, reward=self.right / len(self.letters), turn_reward=hit)
        return StepResult(done=False, observation=f"after {self.letters[self.turn]}", turn_reward=hit)


class LetterChainTask(Task):
    """Options: ``min_turns`` / ``max_turns`` (the range of K), ``alpha`` (the tail index: smaller is
    heavier), ``letters`` (the letters asked about)."""

    name = "letter-chain"
    max_reply_tokens = 2

    def __init__(self, min_turns: int = 1, max_turns: int = 16, alpha: float = 1.0, letters: str = LETTERS) -> None:
        check_long_tail(min_turns, max_turns, alpha, "letter-chain")
        if not letters or any(c not in LETTERS for c in letters):
            raise TypeError(f"letters must be a non-empty string of letters from {LETTERS!r}")
        self.min_turns, self.max_turns, self.alpha, self.letters = min_turns, max_turns, alpha, letters

    def sample(self, rng: random.Random) -> Problem:
        turns = long_tail_count(rng, low=self.min_turns, high=self.max_turns, alpha=self.alpha)
        chain = "".join(rng.choice(self.letters) for _ in range(turns))
        return Problem(key=chain, data=chain)

    def episode(self, problem: Problem) -> Episode:
        return _ChainEpisode(problem.data)

    def warm_start_examples(self, rng: random.Random, count: int) -> list[list[dict[str, str]]]:
        # Format only: every reply is *some* single letter, not the right one.
        examples = []
        for _ in range(count):
            conversation: list[dict[str, str]] = []
            for _ in range(long_tail_count(rng, low=self.min_turns, high=min(self.max_turns, 4), alpha=self.alpha)):
                conversation.append({"role": "user", "content": f"after {rng.choice(self.letters)}"})
                conversation.append({"role": "assistant", "content": rng.choice(string.ascii_lowercase)})
            examples.append(conversation)
        return examples
