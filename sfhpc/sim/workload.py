"""Simulated episodes: GRPO groups of samples whose reply lengths (and numbers of turns) are long-tailed.

Lengths come from the same discrete Pareto tail as the built-in long-tailed tasks
(`sfhpc.tasks.long_tail.long_tail_count`): most replies are short, a few run to the cap, and a synchronous
step waits for its longest one. The multi-turn variant adds a long-tailed number of turns, each turn a
reply, then an observation from the environment after `env_s` seconds (a tool call) during which the
sample holds no place in its engine's batch. The next turn prefills only the observation where the engine
keeps the context (`Workload.prefix_cache`, vLLM's prefix caching), else the whole context so far.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sfhpc.errors import SfhpcError


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    group_size: int = 16
    prompt_tokens: int = 256
    reply_min: int = 512
    reply_max: int = 8192          # max_new_tokens
    reply_alpha: float = 1.2
    turns_min: int = 1
    turns_max: int = 1
    turns_alpha: float = 1.2
    observation_tokens: int = 0    # what the environment adds to the context after each turn but the last
    env_s: float = 0.0             # seconds the environment takes to answer a turn
    # A reply of a task that asks for a length (``repeat-letter``): the drawn length plus `reply_slack`, at most
    # `reply_cap` (0: no cap), and with `group_lengths` one length for a whole group (its samples share the
    # problem, and the test engine writes every reply to its budget).
    reply_slack: int = 0
    reply_cap: int = 0
    group_lengths: bool = False
    # A turn after the first prefills only what the environment added (the engine kept the rest: vLLM's prefix
    # caching); False: the whole context again (the test engine's timing model keeps nothing between requests).
    prefix_cache: bool = True

    def sample(self, sample_id: int, group: Group, replies: tuple[int, ...]) -> Sample:
        return Sample(sample_id, group, replies, self.prompt_tokens, self.observation_tokens, self.prefix_cache)

    def replies(self, rng: np.random.Generator, samples: int) -> list[tuple[int, ...]]:
        """Reply lengths per turn of `samples` samples (whole groups, in order)."""
        if self.group_lengths:
            per_group = self._single_turn(rng, -(-samples // self.group_size))
            return [per_group[i // self.group_size] for i in range(samples)]
        if self.turns_max <= 1:
            return self._single_turn(rng, samples)
        turns = _long_tail(rng, samples, self.turns_min, self.turns_max, self.turns_alpha)
        lengths = iter(_long_tail(rng, sum(turns), self.reply_min, self.reply_max, self.reply_alpha))
        return [tuple(next(lengths) for _ in range(t)) for t in turns]

    def _single_turn(self, rng: np.random.Generator, samples: int) -> list[tuple[int, ...]]:
        lengths = [n + self.reply_slack for n in _long_tail(rng, samples, self.reply_min, self.reply_max,
                                                             self.reply_alpha)]
        return [(min(n, self.reply_cap) if self.reply_cap else n,) for n in lengths]

    def describe(self) -> str:
        text = (f"{self.name}: groups of {self.group_size}, prompt {self.prompt_tokens} tokens, replies "
                f"Pareto(alpha {self.reply_alpha}) in [{self.reply_min}, {self.reply_max}] tokens")
        if self.turns_max > 1:
            text += (f", turns Pareto(alpha {self.turns_alpha}) in [{self.turns_min}, {self.turns_max}], "
                     f"{self.observation_tokens} observation tokens and {self.env_s:g} s of environment per turn")
        return text


# Assumed workloads (no published distribution is reproduced): a reasoning task whose replies have a median
# of about 900 tokens, a mean of about 1,600 and 3.6% cut at the 8k cap, and an agentic one with up to 16
# tool-calling turns.
WORKLOADS: dict[str, Workload] = {
    "long-tail": Workload("long-tail"),
    "multi-turn": Workload("multi-turn", prompt_tokens=512, reply_min=64, reply_max=2048, turns_min=1,
                           turns_max=16, turns_alpha=1.0, observation_tokens=128, env_s=2.0),
}


def workload_named(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise SfhpcError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})") from None


def _long_tail(rng: np.random.Generator, n: int, low: int, high: int, alpha: float) -> list[int]:
    """`n` draws of `sfhpc.tasks.long_tail.long_tail_count`'s distribution (inverse-CDF Pareto of scale
    `low` and index `alpha`, floored, capped at `high`), at once."""
    values = np.floor(low * (1.0 - rng.random(n)) ** (-1.0 / alpha))
    return np.minimum(values, high).astype(np.int64).tolist()


class Group:
    """One GRPO group: its samples, how many have finished, and the oldest policy version among them."""

    __slots__ = ("index", "members", "finished", "oldest_version", "dropped")

    def __init__(self, index: int) -> None:
        self.index = index
        self.members: list[Sample] = []
        self.finished = 0
        self.oldest_version: int | None = None
        self.dropped = False


class Sample:
    """One episode of a group as the simulation follows it through engines and turns."""

    __slots__ = ("id", "group", "replies", "turn", "remaining", "generated", "context", "rank", "finish_v",
                 "prompt", "observation", "first_version", "cached")

    def __init__(self, sample_id: int, group: Group, replies: tuple[int, ...], prompt: int,
                 observation: int = 0, cached: bool = True) -> None:
        self.id = sample_id
        self.group = group
        self.replies = replies
        self.turn = 0
        self.remaining = float(replies[0])  # tokens left to generate in the current turn
        self.generated = 0                  # tokens generated in turns already finished
        self.context = prompt               # tokens to prefill at the next admission
        self.prompt = prompt
        self.observation = observation
        self.rank = -1
        self.finish_v = 0.0
        self.first_version = -1             # the policy version of its first token (-1: none yet)
        self.cached = cached                # its engine keeps its context between turns (prefix caching)

    def context_tokens(self) -> int:
        """Prompt, observations and every token generated so far: what an engine prefills to continue it."""
        return self.prompt + self.generated + self.observation * self.turn

    def finish_turn(self) -> bool:
        """The current turn's reply is complete; True when that was the last turn."""
        self.generated = sum(self.replies[:self.turn + 1])
        if self.turn + 1 >= len(self.replies):
            return True
        self.turn += 1
        self.remaining = float(self.replies[self.turn])
        # With prefix caching the rest of the context is in the engine's cache.
        self.context = self.observation if self.cached else self.context_tokens()
        return False

    @property
    def trained_tokens(self) -> int:
        return self.prompt + sum(self.replies) + self.observation * (len(self.replies) - 1)
