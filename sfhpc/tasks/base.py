"""What a task is: a stream of problems, and for each an episode that answers the agent turn by turn.

An agent opens an episode with its first messages, sends them to the policy (through the agent
endpoint), and hands the reply to `Episode.step`. The episode answers with the next user message (the
environment's observation) or ends with a reward. A task that offers function tools (`Task.tools`) reads
the whole reply message instead (`Episode.step_message`: its text and its tool calls) and answers a call
with the tool's results (`StepResult.messages`). Single-turn tasks end after the first reply;
multi-turn ones decide themselves how long an episode runs (the number of turns may be long-tailed).
Rewards are verifiable: computed from the reply text, never from a model.

Which tasks exist (the built-in names, user code by import path) is `sfhpc.tasks.registry`'s business.
"""

from __future__ import annotations

import abc
import dataclasses
import random
from pathlib import Path
from typing import Any

from sfhpc.errors import ConfigError

DEFAULT_EVALUATION_PROBLEMS = 64  # held-out problems drawn from a task that generates them

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
    # The messages that answer the reply instead of a user observation: the results of the tools it
    # called (``{"role": "tool", "tool_call_id": ..., "content": ...}``), in the order of its calls.
    messages: tuple[dict[str, Any], ...] = ()

    def next_messages(self) -> list[dict[str, Any]]:
        """What the agent sends after the reply: the tools' results, or the observation as a user message."""
        return [dict(m) for m in self.messages] or [{"role": "user", "content": self.observation or ""}]


class Episode(abc.ABC):
    """One problem being solved: the opening messages, then one `step` per policy reply."""

    @abc.abstractmethod
    def opening(self) -> list[dict[str, str]]:
        """The chat messages the first policy call sees."""

    @abc.abstractmethod
    def step(self, reply: str) -> StepResult:
        """Judge the policy's reply; a done result carries the episode's final reward."""

    def step_message(self, message: dict[str, Any]) -> StepResult:
        """Judge the policy's reply as the agent received it, OpenAI's assistant message: ``content`` and,
        when the task offers tools, ``tool_calls`` (each ``{"id", "type": "function", "function": {"name",
        "arguments"}}``, the arguments a JSON string). A task with tools overrides this; the default judges
        the text alone (`step`)."""
        return self.step(message.get("content") or "")

    def reply_tokens(self) -> int | None:
        """Tokens the next reply may hold, when the problem itself bounds it (a reply whose right length is
        known); None: the task's `Task.max_reply_tokens`. The recipe's ``budgets.max_new_tokens`` caps both."""
        return None


class Task(abc.ABC):
    """A family of problems with a verifiable reward."""

    name: str = ""
    #: most policy calls one episode makes (the agent stops the episode with reward 0 after that)
    max_turns: int = 1
    #: tokens the policy may write per reply, where the task bounds them (None: the recipe's budget alone)
    max_reply_tokens: int | None = 8

    @abc.abstractmethod
    def sample(self, rng: random.Random) -> Problem:
        """A problem drawn with `rng`."""

    @abc.abstractmethod
    def episode(self, problem: Problem) -> Episode:
        """A fresh episode of `problem`."""

    # The function tools (OpenAI's shape) the task's agent offers the policy: its warm-start examples are
    # rendered with them, as the agent's calls will be. None: the task uses no tools.
    tools: list[dict[str, Any]] | None = None

    def warm_start_examples(self, rng: random.Random, count: int) -> list[list[dict[str, Any]]]:
        """Conversations for a short supervised warm start that teaches the reply *format* only (the
        answers are not the solutions, so reward still has to be learned by RL). Empty: no warm start."""
        return []

    def check(self) -> None:
        """Find what is wrong with the task's input before any job starts (a data file: missing, empty,
        without the named keys), as a `ConfigError`. Construction stays cheap, since every rank builds the
        task and only the controller samples problems; the default has nothing to read."""
        return None

    def evaluation_problems(self, path: Path | None, count: int | None, seed: int, *, source: str) -> list[Problem]:
        """The held-out problems of a recipe's ``evaluation`` section (`sfhpc.rl.evaluation`), the same at
        every evaluation of a run: from the data file `path`, or, for a task that generates its problems,
        `count` drawn with a generator of their own seeded by `seed` (64 when None), so the training sampler
        and the controller's draws are untouched. A task with a sampler state of its own overrides this."""
        if path is not None:
            raise ConfigError(source, "evaluation.path", f"task '{self.name}' reads no data file: it generates its "
                                                         "problems; leave evaluation.path out")
        rng = random.Random(seed)
        return [self.sample(rng) for _ in range(count or DEFAULT_EVALUATION_PROBLEMS)]

    def state(self) -> Any:
        """The sampler's position, saved with each checkpoint as JSON (None: the controller's RNG is all
        there is): plain data only (None, bool, numbers, str, lists, dicts with str keys)."""
        return None

    def restore(self, state: Any) -> None:
        """Continue from a `state` this task's `state` returned."""
        return None

    def problem_to_json(self, data: Any) -> Any:
        """A problem's ``data`` as plain data (None, bool, numbers, str, lists, dicts with str keys), for the
        controller's checkpoint: a resume reads no pickles. The default takes data that already is; a task
        whose problems hold other objects converts them here and back in `problem_from_json`."""
        return data

    def problem_from_json(self, value: Any) -> Any:
        """The ``data`` that `problem_to_json` wrote (JSON has no tuples: a tuple comes back as a list)."""
        return value

    @classmethod
    def from_options(cls, options: dict[str, Any], *, source: str, base_dir: Path | None) -> Task:
        """The task a recipe's ``task.options`` describe. A task whose options name files overrides this
        to read them relative to `base_dir` (the recipe's folder) and name a bad option's key."""
        return cls(**options)
