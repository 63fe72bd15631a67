"""An episode whose agent or task raises, or outlives its timeout, fails its trajectory; it never raises."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.store import TrajectoryStore, open_store
from sfhpc.rollout.agent import ChatBackend, EpisodeOutcome, Reply, play_episode
from sfhpc.rollout.supervise import REASON_CHARS, describe_failure, play_or_fail
from sfhpc.tasks.base import Episode, Problem, StepResult, Task


class _Backend(ChatBackend):
    """Starts the trajectory in the manager on the first turn (as the endpoint does); replies "7" after
    `delays[turn]` seconds."""

    def __init__(self, manager: TrajectoryManager, delays: dict[int, float] | None = None) -> None:
        self.manager, self.delays, self.turns = manager, delays or {}, 0

    async def chat(self, messages: list[dict[str, Any]], *, trajectory_id: str | None, task: str, group: str,
                   max_tokens: int, seed: int | None, tools: list[dict[str, Any]] | None = None) -> Reply:
        self.turns += 1
        if trajectory_id is None:
            trajectory_id = self.manager.start([1, 2, 3], task=task, group=group)
        await asyncio.sleep(self.delays.get(self.turns, 0.0))
        self.manager.add_generated(trajectory_id, [7], [-0.5], 0)
        return Reply.of_text("7", trajectory_id)


class _Episode(Episode):
    def __init__(self, fault: str) -> None:
        self.fault, self.turns = fault, 0

    def opening(self) -> list[dict[str, str]]:
        if self.fault == "opening":
            raise RuntimeError("no opening for this problem")
        return [{"role": "user", "content": "go"}]

    def step(self, reply: str) -> StepResult:
        self.turns += 1
        if self.fault == "second-step" and self.turns == 2:
            raise ValueError(f"invalid literal for int() with base 10: {reply}²")
        return StepResult(done=self.turns == 3, reward=1.0, observation="again")


class _Task(Task):
    name, max_turns = "faulty", 3

    def sample(self, rng: random.Random) -> Problem:
        return Problem("p", None)

    def episode(self, problem: Problem) -> Episode:
        return _Episode(problem.data)


def _play(manager: TrajectoryManager, fault: str | None, *, delays: dict[int, float] | None = None,
          timeout_s: float = 5.0) -> EpisodeOutcome | None:
    backend, task = _Backend(manager, delays), _Task()

    async def play(on_trajectory: Callable[[str], None]) -> EpisodeOutcome:
        return await play_episode(backend, task, Problem("p", fault), group="g", on_trajectory=on_trajectory)

    return asyncio.run(play_or_fail(play, manager, task=task.name, group="g", timeout_s=timeout_s))


def test_a_good_episode_is_finished_with_its_reward() -> None:
    manager = TrajectoryManager()
    outcome = _play(manager, None)
    assert outcome is not None and outcome.turns == 3
    assert manager.status(outcome.trajectory_id) == "finished"


def test_a_task_that_raises_in_a_later_turn_fails_that_trajectory(tmp_path: Path) -> None:
    manager = TrajectoryManager(TrajectoryStore.create(tmp_path / "run.h5"))
    assert _play(manager, "second-step") is None
    manager.close()
    with open_store(tmp_path / "run.h5") as store:
        (failed,) = store.trajectories()  # the episode's own trajectory, not a new one
    assert failed.status == "failed" and failed.fail_reason == "ValueError: invalid literal for int() with base 10: 7²"
    assert failed.num_generated == 2  # both replies the agent got before the task raised


def test_a_failure_before_the_first_reply_is_still_reported() -> None:
    manager = TrajectoryManager()
    manager.book_group("g")
    assert _play(manager, "opening") is None
    assert manager.counts()["failed"] == 1 and manager.groups_in_flight() == 0  # the controller hands out another
    assert manager.fail_reasons() == ["RuntimeError: no opening for this problem"]


def test_an_episode_past_its_timeout_fails_with_the_time() -> None:
    manager = TrajectoryManager()
    assert _play(manager, None, delays={2: 30.0}, timeout_s=0.2) is None  # hangs in its second turn
    assert manager.fail_reasons() == ["timed out after 0.2 s"]
    assert manager.counts()["failed"] == 1 and manager.counts()["running"] == 0


def test_a_reason_is_one_short_line() -> None:
    assert describe_failure(KeyError("answer")) == "KeyError: 'answer'"
    assert describe_failure(RuntimeError()) == "RuntimeError"
    long = describe_failure(ValueError("line one\nline two " + "x" * 2000))
    assert long.startswith("ValueError: line one line two x") and "\n" not in long
    assert len(long) == REASON_CHARS and long.endswith("...")
