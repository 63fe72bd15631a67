"""An agent: plays one episode of a task by chatting with the policy through the agent endpoint.

The agent is an ordinary chat client. It does not see tokens, versions or pauses: the endpoint records
every token in the trajectory manager, and a weight update only makes a call take longer. Two ways to
reach the endpoint, with the same semantics:

* `LocalChat`: in process (Python agents on the rollout rank, no HTTP);
* `OpenAIChat`: the official ``openai`` client over HTTP, as an agent in any language would.

The trajectory id of an episode comes back with the first reply and travels with every later call; the
GRPO group (one problem's samples) travels as ``X-Group``.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from sfhpc.endpoint.client import AsyncLocalClient
from sfhpc.tasks.base import Episode, Problem, Task


@dataclasses.dataclass(frozen=True)
class Reply:
    """A reply as the agent received it: OpenAI's assistant message (``content``, and ``tool_calls`` when
    the policy called tools), the trajectory it continues and why it ended."""

    message: dict[str, Any]
    trajectory_id: str
    finish_reason: str

    @classmethod
    def of_text(cls, text: str, trajectory_id: str, finish_reason: str = "stop") -> Reply:
        return cls({"role": "assistant", "content": text}, trajectory_id, finish_reason)

    @property
    def text(self) -> str:
        return self.message.get("content") or ""


class ChatBackend(abc.ABC):
    """One chat call to the policy for a given trajectory (None: start a new one), offering `tools`
    (OpenAI's function tools) when the task has them."""

    @abc.abstractmethod
    async def chat(self, messages: list[dict[str, Any]], *, trajectory_id: str | None, task: str, group: str,
                   max_tokens: int, seed: int | None, tools: list[dict[str, Any]] | None = None) -> Reply: ...


def _message(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant message as the history sends it back: its role, content and tool calls only."""
    kept = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        kept["tool_calls"] = message["tool_calls"]
    return kept


class LocalChat(ChatBackend):
    def __init__(self, client: AsyncLocalClient, model: str) -> None:
        self.client, self.model = client, model

    async def chat(self, messages: list[dict[str, Any]], *, trajectory_id: str | None, task: str, group: str,
                   max_tokens: int, seed: int | None, tools: list[dict[str, Any]] | None = None) -> Reply:
        offered: dict[str, Any] = {"tools": tools} if tools else {}
        body = await self.client.chat(trajectory_id=trajectory_id, task=task, group=group, model=self.model,
                                      messages=messages, max_tokens=max_tokens, seed=seed, **offered)
        choice = body["choices"][0]
        return Reply(_message(choice["message"]), body["trajectory_id"], choice["finish_reason"])


class OpenAIChat(ChatBackend):
    """Through ``openai.AsyncOpenAI`` pointed at the endpoint's URL."""

    def __init__(self, base_url: str, model: str, api_key: str = "unused") -> None:
        import openai

        # trust_env=False: a site's HTTP_PROXY must not receive the run's key and prompts (the endpoint is
        # on the cluster's own network).
        self.client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600,
                                         http_client=openai.DefaultAsyncHttpxClient(trust_env=False))
        self.model = model

    async def chat(self, messages: list[dict[str, Any]], *, trajectory_id: str | None, task: str, group: str,
                   max_tokens: int, seed: int | None, tools: list[dict[str, Any]] | None = None) -> Reply:
        headers = {"X-Task": task, "X-Group": group}
        if trajectory_id is not None:
            headers["X-Trajectory-Id"] = trajectory_id
        reply: Any = await self.client.chat.completions.create(
            model=self.model, messages=messages, max_tokens=max_tokens, seed=seed,
            extra_headers=headers, **({"tools": tools} if tools else {}))  # type: ignore[call-overload]
        choice = reply.choices[0]
        message = _message(choice.message.model_dump(exclude_none=True))
        return Reply(message, reply.model_extra["trajectory_id"], choice.finish_reason)


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where an episode of an earlier allocation stopped: its trajectory and the policy's whole replies so
    far (assistant messages, as the agent received them). The episode is rebuilt by replaying those
    replies, which holds for any task whose episode is a function of its problem and the replies (every
    shipped task)."""

    trajectory_id: str
    replies: tuple[dict[str, Any], ...]


@dataclasses.dataclass(frozen=True)
class EpisodeOutcome:
    trajectory_id: str
    reward: float
    turns: int
    turn_rewards: tuple[float, ...]
    # An episode of several agents: the other agents' trajectories, each with its reward.
    others: tuple[tuple[str, float], ...] = ()


def reply_budget(task: Task, max_tokens: int | None) -> int:
    """Tokens one reply may hold: the recipe's budget (``budgets.max_new_tokens``), narrowed by the task's own
    `max_reply_tokens` where it has one."""
    bounds = [b for b in (task.max_reply_tokens, max_tokens) if b is not None]
    if not bounds:
        raise ValueError(f"task '{task.name}' has no reply bound and none was given")
    return min(bounds)


def turn_budget(episode: Episode, budget: int) -> int:
    """Tokens the episode's next reply may hold: `budget` (`reply_budget`), narrowed by the problem's own bound
    on that reply where it has one (`Episode.reply_tokens`)."""
    bound = episode.reply_tokens()
    return budget if bound is None else min(bound, budget)


def resumed_turn_budget(task: Task, problem: Problem, earlier: Sequence[dict[str, Any]], max_tokens: int | None) -> int:
    """`turn_budget` of the reply that follows the `earlier` ones (assistant messages, as the agent received
    them): a reply cut short and continued elsewhere keeps the bound its own turn had."""
    episode = task.episode(problem)
    for message in earlier:
        episode.step_message(message)
    return turn_budget(episode, reply_budget(task, max_tokens))


def reply_budget_line(task: Task, max_new_tokens: int) -> str:
    """What a run prints at its start about the reply budget: the recipe's, and the task's narrowing of it."""
    budget = reply_budget(task, max_new_tokens)
    if budget < max_new_tokens:
        return (f"reply budget: {budget} tokens: task '{task.name}' narrows budgets.max_new_tokens ({max_new_tokens}) "
                f"to its own max_reply_tokens")
    return f"reply budget: {budget} tokens (budgets.max_new_tokens)"


async def play_episode(backend: ChatBackend, task: Task, problem: Problem, *, group: str,
                       seed: int | None = None, max_tokens: int | None = None,
                       resume: ResumePoint | None = None,
                       on_trajectory: Callable[[str], None] | None = None) -> EpisodeOutcome:
    """Run one episode to its end (from `resume` on, if given); the caller records the reward (`finish`)
    with the returned outcome. `on_trajectory` hears the trajectory id as soon as the first reply names it
    (an episode that fails later must fail that trajectory)."""
    reply_tokens = reply_budget(task, max_tokens)
    episode = task.episode(problem)
    messages = episode.opening()
    trajectory_id: str | None = None if resume is None else resume.trajectory_id
    turn_rewards: list[float] = []
    replayed = list(resume.replies) if resume is not None else []
    for turn in range(1, task.max_turns + 1):
        if replayed:  # a reply the policy gave in the earlier allocation: the episode sees it again
            reply = Reply(replayed.pop(0), trajectory_id or "", "stop")
        else:
            reply = await backend.chat(messages, trajectory_id=trajectory_id, task=task.name, group=group,
                                       max_tokens=turn_budget(episode, reply_tokens),
                                       seed=None if seed is None else seed + turn, tools=task.tools)
        if trajectory_id is None and on_trajectory is not None:
            on_trajectory(reply.trajectory_id)
        trajectory_id = reply.trajectory_id
        result = episode.step_message(reply.message)
        turn_rewards.append(result.turn_reward)
        if result.done:
            return EpisodeOutcome(trajectory_id, result.reward, turn, tuple(turn_rewards))
        messages = [*messages, reply.message, *result.next_messages()]
    assert trajectory_id is not None
    return EpisodeOutcome(trajectory_id, 0.0, task.max_turns, tuple(turn_rewards))
