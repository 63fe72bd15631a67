"""What a task is: a stream of problems, and for each an episode that answers the agent turn by turn.

An agent opens an episode with its first messages, sends them to the policy (through the agent
endpoint), and hands the reply to `Episode.step`. The episode answers with the next user message (the
environment's observation) or ends with a reward. Single-turn tasks end after the first reply;
multi-turn ones decide themselves how long an episode runs (the number of turns may be long-tailed).
Rewards are verifiable: computed from the reply text, never from a model.
"""

from __future__ import annotations

import abc
import dataclasses
import random
from collections.abc import Callable
from typing import Any

from sfhpc.config.recipe import TaskSpec
from sfhpc.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Problem:
    """One task instance. ``key`` names it (GRPO groups the samples of one key); ``data`` is the task's own."""

    key: str
    data: Any


@dataclasses.dataclass(frozen=True)
class StepResult:
    """The environment's answer to one reply: the next user message, or the end with the episode reward."""

    done: bool
    reward: float = 0.0
    observation: str | None = None
    turn_reward: float = 0.0


class Episode(abc.ABC):
    """One problem being solved: the opening messages, then one `step` per policy reply."""

    @abc.abstractmethod
    def opening(self) -> list[dict[str, str]]:
        """The chat messages the first policy call sees."""

    @abc.abstractmethod
    def step(self, reply: str) -> StepResult:
        """Judge the policy's reply; a done result carries the episode's final reward."""


class Task(abc.ABC):
    """A family of problems with a verifiable reward."""

    name: str = ""
    #: most policy calls one episode makes (the agent stops the episode with reward 0 after that)
    max_turns: int = 1
    #: tokens the policy may write per reply
    max_reply_tokens: int = 8

    @abc.abstractmethod
    def sample(self, rng: random.Random) -> Problem:
        """A problem drawn with `rng`."""

    @abc.abstractmethod
    def episode(self, problem: Problem) -> Episode:
        """A fresh episode of `problem`."""

    def warm_start_examples(self, rng: random.Random, count: int) -> list[list[dict[str, str]]]:
        """Conversations for a short supervised warm start that teaches the reply *format* only (the
        answers are not the solutions, so reward still has to be learned by RL). Empty: no warm start."""
        return []


_REGISTRY: dict[str, Callable[[dict[str, Any]], Task]] = {}


def register(name: str) -> Callable[[Callable[..., Task]], Callable[..., Task]]:
    def add(factory: Callable[..., Task]) -> Callable[..., Task]:
        _REGISTRY[name] = factory
        return factory
    return add


def get_task(spec: TaskSpec, source: str = "recipe") -> Task:
    """The task a recipe names, built with its options; ConfigError for an unknown name or bad options."""
    import sfhpc.tasks.guess_number  # noqa: F401  (registers the shipped tasks)
    import sfhpc.tasks.letters  # noqa: F401

    if spec.name not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY))
        raise ConfigError(source, "task.name", f"unknown task '{spec.name}' (known: {known})")
    options = spec.options or {}
    if not isinstance(options, dict):
        raise ConfigError(source, "task.options", "expected a mapping of option names to values")
    try:
        return _REGISTRY[spec.name](**options)
    except TypeError as exc:
        raise ConfigError(source, "task.options", f"bad options for task '{spec.name}': {exc}") from None
