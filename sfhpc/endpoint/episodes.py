"""Episodes: one URL per agent episode, so that an unmodified OpenAI client needs no trajectory id.

An agent written for the OpenAI API sends no trajectory id: it knows a base URL and a key. Before a rollout
rank starts such a program it opens an episode here and gives the program
``OPENAI_BASE_URL=http://HOST:PORT/episodes/<id>/v1``. Every call on that URL is a turn of the episode's one
trajectory:

- the first call starts the trajectory, labelled with the episode's task and GRPO group. A first call that
  names an id of its own (the ``X-Trajectory-Id`` header or the ``user`` field: a client's session id) gets a
  trajectory under that id;
- every later call ``observe``s its prompt on that trajectory (a conversation that grows is one branch, one
  that goes back forks), whether it names the id again or not; a call naming another id is refused;
- the program may report a reward (``POST /episodes/<id>/reward``); the episode keeps the text of the last
  reply, which the task's verifier judges when the program reports none.

When the program has ended, the rank closes the episode: later calls on its URL get a 404.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable
from typing import Any

from sfhpc.endpoint.errors import BadRequest, NotFound
from sfhpc.endpoint.fields import Fields


@dataclasses.dataclass(eq=False)
class OpenEpisode:
    """The state of one open episode (only touched on the endpoint's event loop)."""

    id: str
    task: str = ""
    group: str | None = None
    metadata: dict[str, Any] | None = None
    #: hears the trajectory id as soon as the first call has started it (a failure later must fail it)
    on_trajectory: Callable[[str], None] | None = None
    trajectory_id: str | None = None
    calls: int = 0                 # completed calls (turns that produced a reply)
    last_reply: str | None = None  # text of the latest reply: what the task's verifier judges
    reward: float | None = None    # a reward the program posted
    starting: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)

    def started(self, trajectory_id: str) -> None:
        self.trajectory_id = trajectory_id
        if self.on_trajectory is not None:
            self.on_trajectory(trajectory_id)

    def replied(self, text: str) -> None:
        self.calls += 1
        self.last_reply = text

    def check_id(self, chosen: str | None) -> None:
        """A later call may repeat the episode's trajectory id, never name another one."""
        if chosen and self.trajectory_id is not None and chosen != self.trajectory_id:
            raise BadRequest(f"episode {self.id!r} records trajectory {self.trajectory_id!r}, but the call names "
                             f"{chosen!r}; every call on an episode's URL belongs to its one trajectory (send "
                             f"the same session id, or none)", param="user")


class Episodes:
    """The open episodes of one endpoint, by id."""

    def __init__(self) -> None:
        self._open: dict[str, OpenEpisode] = {}

    def open(self, *, task: str = "", group: str | None = None, metadata: dict[str, Any] | None = None,
             on_trajectory: Callable[[str], None] | None = None) -> OpenEpisode:
        # A random id: one episode's URL says nothing about another's (the run's token guards them all).
        episode = OpenEpisode(uuid.uuid4().hex, task, group, metadata, on_trajectory)
        self._open[episode.id] = episode
        return episode

    def get(self, episode_id: str) -> OpenEpisode:
        episode = self._open.get(episode_id)
        if episode is None:
            raise NotFound(f"no open episode {episode_id!r} here: it ended, or the URL is not the one this "
                           f"episode's OPENAI_BASE_URL gave", param="episode", code="episode_not_found")
        return episode

    def close(self, episode_id: str) -> OpenEpisode | None:
        return self._open.pop(episode_id, None)

    def __len__(self) -> int:
        return len(self._open)


def parse_reward(body: Any) -> float:
    """The reward of ``POST /episodes/<id>/reward``: ``{"reward": <finite number>}``."""
    if not isinstance(body, dict):
        raise BadRequest('the body must be {"reward": <a finite number>}', param="reward")
    reward = Fields(body).number("reward", default=None, required=True)
    assert reward is not None
    return reward
