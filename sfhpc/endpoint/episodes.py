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
- the program may report a reward (``POST /episodes/<id>/reward``) where the run takes posted rewards
  (``agent.reward_source: post``); elsewhere the post is refused (403) and counted, so that code the model
  wrote cannot pay itself. The episode keeps the text of the last reply, which the task's verifier judges
  when the program reports none.

Each episode has a key of its own (``OPENAI_API_KEY`` of its program): it opens that episode's URLs and no
other (403 elsewhere), so one episode's program cannot touch another's trajectories. The endpoint keeps the
last refusal of an episode's calls, so an episode that got no reply fails naming why.

Several agents. An episode may be played by several agents (a solver and a checker, the players of one
game): ``/episodes/<id>/agents/<name>/v1`` is agent ``<name>``'s URL, and each agent's calls are a
trajectory of its own, in the episode's group, its metadata naming the agent and the episode (``agent``,
``episode``), with a reward of its own (``POST /episodes/<id>/agents/<name>/reward``). The episode's own URL
is the agent without a name.

When the program has ended, the rank closes the episode: later calls on its URL get a 404.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import secrets
import uuid
from collections.abc import Callable
from typing import Any

from sfhpc.data.trajectory import AGENT_KEY, EPISODE_KEY
from sfhpc.endpoint.errors import BadRequest, EndpointError, Forbidden, NotFound
from sfhpc.endpoint.fields import Fields

AGENT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclasses.dataclass(eq=False)
class Seat:
    """One agent of an episode: its trajectories and what its calls left (only touched on the endpoint's loop).

    An agent has one trajectory, and one more per extra choice of a call that asked for ``n > 1``; a later
    call continues the trajectory its history holds (`continued_by`)."""

    agent: str
    trajectories: list[str] = dataclasses.field(default_factory=list)  # oldest first
    replies: dict[str, str] = dataclasses.field(default_factory=dict)  # the text of each one's latest reply
    calls: int = 0                 # completed calls (turns that produced a reply)
    reward: float | None = None    # a reward the program posted
    starting: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)

    @property
    def trajectory_id(self) -> str | None:
        """The agent's first trajectory (its only one unless a call asked for several choices)."""
        return self.trajectories[0] if self.trajectories else None

    @property
    def last_reply(self) -> str | None:
        return self.replies.get(self.trajectories[0]) if self.trajectories else None

    def continued_by(self, prompt: tuple[int, ...], context_of: Callable[[str], tuple[int, ...]]) -> str:
        """The trajectory a call with `prompt` continues: the one whose tokens so far (`context_of`) it
        repeats the most of (the choice its history holds), the newest on a tie."""
        def shared(trajectory_id: str) -> int:
            context = context_of(trajectory_id)
            n = min(len(context), len(prompt))
            return next((i for i in range(n) if context[i] != prompt[i]), n)
        return max(reversed(self.trajectories), key=shared)

    def replied(self, trajectory_id: str, text: str) -> None:
        self.calls += 1
        self.replies[trajectory_id] = text


@dataclasses.dataclass(eq=False)
class OpenEpisode:
    """The state of one open episode (only touched on the endpoint's event loop): a `Seat` per agent that
    called, ``""`` for the episode's own URL."""

    id: str
    task: str = ""
    group: str | None = None
    metadata: dict[str, Any] | None = None
    #: hears each trajectory id as soon as a first call has started it (a failure later must fail it)
    on_trajectory: Callable[[str], None] | None = None
    takes_posted_reward: bool = False  # agent.reward_source: post
    seats: dict[str, Seat] = dataclasses.field(default_factory=dict)
    #: the bearer key of this episode's program: it opens this episode's URLs alone
    key: str = dataclasses.field(default_factory=lambda: secrets.token_urlsafe(24))
    refusal: str | None = None  # the last call refused: "400 <message>"

    def seat(self, agent: str = "") -> Seat:
        if agent and not AGENT_NAME.match(agent):
            raise BadRequest(f"agent name {agent!r}: use 1-64 letters, digits, '_', '-' or '.'", param="agent")
        return self.seats.setdefault(agent, Seat(agent))

    def trajectory_metadata(self, seat: Seat) -> dict[str, Any] | None:
        """The metadata of an agent's next trajectory: the episode's; for a named agent its name and the
        episode; for an extra choice of the unnamed agent its first trajectory (one episode, to the group)."""
        if seat.agent:
            return {**(self.metadata or {}), AGENT_KEY: seat.agent, EPISODE_KEY: self.id}
        if seat.trajectories:
            return {**(self.metadata or {}), EPISODE_KEY: seat.trajectories[0]}
        return self.metadata

    def started(self, seat: Seat, trajectory_id: str) -> None:
        seat.trajectories.append(trajectory_id)
        if self.on_trajectory is not None:
            self.on_trajectory(trajectory_id)

    def check_id(self, seat: Seat, chosen: str | None) -> None:
        """A later call may repeat one of its agent's trajectory ids, never name another one."""
        if chosen and seat.trajectories and chosen not in seat.trajectories:
            raise BadRequest(f"episode {self.id!r} records trajectory {seat.trajectory_id!r}, but the call names "
                             f"{chosen!r}; every call on an episode's URL belongs to its trajectory (send "
                             f"the same session id, or none)", param="user")


class Episodes:
    """The open episodes of one endpoint, by id."""

    def __init__(self) -> None:
        self._open: dict[str, OpenEpisode] = {}
        self._by_key: dict[str, OpenEpisode] = {}
        self.rewards_refused = 0  # reward posts refused: the run takes its rewards elsewhere

    def open(self, *, task: str = "", group: str | None = None, metadata: dict[str, Any] | None = None,
             on_trajectory: Callable[[str], None] | None = None, takes_posted_reward: bool = False) -> OpenEpisode:
        # A random id: one episode's URL says nothing about another's (its key guards it).
        episode = OpenEpisode(uuid.uuid4().hex, task, group, metadata, on_trajectory, takes_posted_reward)
        self._open[episode.id] = episode
        self._by_key[episode.key] = episode
        return episode

    def check_key(self, key: str, episode_id: str | None) -> bool:
        """Whether `key` is an open episode's and opens `episode_id` (False: it is no episode's key at all);
        `Forbidden` when it is another episode's, or the route is not an episode's."""
        episode = self._by_key.get(key)
        if episode is None:
            return False
        if episode.id != episode_id:
            raise Forbidden(f"this key opens the URLs of episode {episode.id!r} alone, not "
                            f"{'episode ' + repr(episode_id) if episode_id else 'this route'}", param="episode")
        return True

    def refused(self, episode_id: str, error: EndpointError) -> None:
        """Keep `error` as the episode's last refused call (no-op for an episode not open)."""
        episode = self._open.get(episode_id)
        if episode is not None:
            episode.refusal = f"{error.status} {error.message}"

    def post_reward(self, episode_id: str, agent: str, body: Any) -> float:
        """A program's posted reward for its episode (or one of its agents), where the episode takes one."""
        episode = self.get(episode_id)
        if not episode.takes_posted_reward:
            self.rewards_refused += 1
            raise Forbidden("this run does not take rewards posted by agent programs (agent.reward_source is not "
                            "post): the reward comes from the program's end line or the task's verifier",
                            param="reward", code="reward_not_taken")
        seat = episode.seat(agent)
        seat.reward = parse_reward(body)
        return seat.reward

    def get(self, episode_id: str) -> OpenEpisode:
        episode = self._open.get(episode_id)
        if episode is None:
            raise NotFound(f"no open episode {episode_id!r} here: it ended, or the URL is not the one this "
                           f"episode's OPENAI_BASE_URL gave", param="episode", code="episode_not_found")
        return episode

    def close(self, episode_id: str) -> OpenEpisode | None:
        episode = self._open.pop(episode_id, None)
        if episode is not None:
            self._by_key.pop(episode.key, None)
        return episode

    def __len__(self) -> int:
        return len(self._open)


def parse_reward(body: Any) -> float:
    """The reward of ``POST /episodes/<id>/reward``: ``{"reward": <finite number>}``."""
    if not isinstance(body, dict):
        raise BadRequest('the body must be {"reward": <a finite number>}', param="reward")
    reward = Fields(body).number("reward", default=None, required=True)
    assert reward is not None
    return reward
