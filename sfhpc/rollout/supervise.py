"""An episode under supervision: it ends in the trajectory manager either way, finished or failed.

An agent or a task is user code and may raise (a parser that meets ``'²'``) or never return (a hung
tool, a stuck engine). Either must cost one episode, not the run: the episode's trajectory is *failed*
with a one-line reason ("ValueError: ...", "timed out after 600 s") and the controller replaces its
GRPO group. An episode that fails before its first reply named its trajectory is recorded as a failed
trajectory of its own, with an empty prompt, so that the controller still learns about it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from sfhpc.rollout.agent import EpisodeOutcome

log = logging.getLogger("sfhpc")

REASON_CHARS = 500  # a reason is read in one line of an error message; a traceback goes to the rank's log


class EpisodeRecorder(Protocol):
    """What supervision records in: the trajectory manager (or its client on a rollout rank)."""

    def start(self, prompt_tokens: Sequence[int], *, task: str = "", group: str | None = None,
              metadata: dict | None = None, trajectory_id: str | None = None) -> str: ...

    def finish_episode(self, trajectory_id: str, reward: float | None = None, *, turn_rewards: Any = None,
                       others: Sequence[tuple[str, float | None]] = ()) -> None: ...

    def fail_episode(self, trajectory_ids: Sequence[str], reason: str) -> None: ...


def describe_failure(exc: BaseException) -> str:
    """``"ValueError: invalid literal ..."``: the exception's class and message on one line, cut to
    REASON_CHARS."""
    text = " ".join(str(exc).split())
    reason = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return reason if len(reason) <= REASON_CHARS else reason[:REASON_CHARS - 3] + "..."


async def play_or_fail(play: Callable[[Callable[[str], None]], Awaitable[EpisodeOutcome]],
                       recorder: EpisodeRecorder, *, task: str, group: str, timeout_s: float | None,
                       stopping: Callable[[], bool] = lambda: False) -> EpisodeOutcome | None:
    """Play one episode and record its end: `finish` with the reward, or `fail` with the reason.

    `play` receives a callback to call with the trajectory id as soon as it is known, so a failure in a
    later turn fails the right trajectory. Returns the outcome, or None when the episode failed.
    Cancellation (the rank closing down) is not a failure and goes through; nor is an error while the
    rank is `stopping` (a stop signal took its engine away): the trajectory stays interrupted, and a
    restarted run continues it.
    """
    known: list[str] = []
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            outcome = await play(known.append)
    except Exception as exc:
        if stopping():
            log.info("episode of group %s cut by the stop (%s); it continues after a restart", group,
                     describe_failure(exc))
            return None
        if deadline.expired() or getattr(exc, "seconds", None) is not None:  # here, or where the program ran
            reason = f"timed out after {getattr(exc, 'seconds', None) or timeout_s:g} s"
            log.warning("episode of group %s failed: %s", group, reason)
        else:
            reason = describe_failure(exc)
            log.warning("episode of group %s failed: %s", group, reason, exc_info=exc)
    else:
        # One end per episode, its other agents' trajectories with it.
        recorder.finish_episode(outcome.trajectory_id, outcome.reward, turn_rewards=list(outcome.turn_rewards),
                                others=outcome.others)
        return outcome
    # Every trajectory the episode started fails with it (one per agent of an episode of several).
    recorder.fail_episode(known or [recorder.start([], task=task, group=group)], reason)
    return None
