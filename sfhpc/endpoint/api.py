"""The OpenAI-compatible API of one endpoint, apart from any transport.

The HTTP server and the in-process client both go through `OpenAIApi.call`, so an agent gets the same
validation, trajectory bookkeeping, responses and errors whichever way it connects.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from sfhpc.endpoint import responses
from sfhpc.endpoint.episodes import Episodes, OpenEpisode, Seat, parse_reward
from sfhpc.endpoint.protocol import ApiRequest, Identity, ResponseBuilder, Route, models_body, parse
from sfhpc.endpoint.service import AgentEndpoint, SamplingRule, Turn, TurnRequest, TurnResult
from sfhpc.engine.tokenizer import ByteTokenizer, ChatTokenizer

log = logging.getLogger(__name__)


class Call:
    """One accepted request: its trajectory is known, the turn is open, the answer not yet produced."""

    def __init__(self, request: ApiRequest, turn: Turn, builder: ResponseBuilder,
                 on_result: Callable[[TurnResult], None] | None = None,
                 counts: collections.Counter[str] | None = None) -> None:
        self.request = request
        self._turn = turn
        self._builder = builder
        self._on_result = on_result
        self._counts = counts

    def _done(self, result: TurnResult) -> None:
        if self._on_result is not None:
            self._on_result(result)

    def _read(self) -> None:
        """Count what the reply held for the tools offered (once the response is built)."""
        parsed = self._builder.parsed
        if parsed is None or self._counts is None:
            return
        self._counts["tool_calls"] += len(parsed.calls)
        if parsed.failed:
            self._counts["tool_call_parse_failures"] += 1
            log.warning("trajectory %s: a reply began a tool call that does not parse; returned as content",
                        self.trajectory_id)

    @property
    def trajectory_id(self) -> str:
        return self._turn.trajectory_id

    @property
    def stream(self) -> bool:
        return self.request.stream

    async def response(self) -> dict[str, Any]:
        """The whole response body (for ``stream: false``)."""
        async for _ in self._turn.stream():
            pass
        assert self._turn.result is not None
        self._done(self._turn.result)
        body = self._builder.full(self._turn.result)
        self._read()
        return body

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The streamed chunks, without the SSE framing and the closing ``[DONE]``."""
        yield self._builder.first_chunk()
        async for delta in self._turn.stream():
            yield self._builder.delta_chunk(delta)
        result = self._turn.result
        assert result is not None
        self._done(result)
        for chunk in self._builder.last_chunks(result):
            yield chunk
        self._read()
        if self.request.include_usage:
            yield self._builder.usage_chunk(result)


class OpenAIApi:
    """Routes of the OpenAI API over one `AgentEndpoint`, serving one model name.

    `token` is the bearer token every HTTP transport of this API demands (`EndpointServer`,
    `start_site`); the in-process client calls the API directly and needs none. `episodes` are the open
    per-episode URLs (see `sfhpc.endpoint.episodes`). With a `sampling_rule` (an RL run's), a turn that asks
    for no temperature gets the run's default, and sampling the trainer cannot match is refused.
    `tool_parser` names the format of the model's tool calls (by default the one its chat template writes).
    `counts` holds what the replies held: ``tool_calls`` read, ``tool_call_parse_failures`` (replies that
    began a call that does not parse, returned as content); ``GET /health`` shows them.
    """

    def __init__(self, endpoint: AgentEndpoint, *, model_name: str, tokenizer: ChatTokenizer | None = None,
                 token: str | None = None, sampling_rule: SamplingRule | None = None,
                 tool_parser: str | None = None) -> None:
        self.endpoint = endpoint
        self.model_name = model_name
        self.token = token
        # The served model's own tokenizer (`sfhpc.engine.tokenizer.load_tokenizer`); the byte-level one
        # when none is given (sfhpc's tiny model and the tests' scripted engines speak it).
        self.tokenizer: ChatTokenizer = tokenizer or ByteTokenizer()
        self.created = int(time.time())
        self.episodes = Episodes()
        self.sampling_rule = sampling_rule
        self.tool_parser = tool_parser
        self.counts: collections.Counter[str] = collections.Counter()

    def models(self) -> dict[str, Any]:
        return models_body(self.model_name, self.created)

    def health(self) -> dict[str, Any]:
        engine = self.endpoint.engine
        return {"status": "ok", "model": self.model_name, "engine": engine.name, "version": engine.version,
                "paused": engine.paused, "tool_calls": self.counts["tool_calls"],
                "tool_call_parse_failures": self.counts["tool_call_parse_failures"]}

    @contextlib.asynccontextmanager
    async def call(self, route: Route, body: Any, identity: Identity | None = None) -> AsyncIterator[Call]:
        """Validate `body` and open its turn; raises `EndpointError` before anything is generated."""
        identity = identity or Identity()
        episode = None if identity.episode is None else self.episodes.get(identity.episode)
        request = parse(route, body, model_name=self.model_name, tokenizer=self.tokenizer, identity=identity,
                        tool_parser=self.tool_parser)
        if self.sampling_rule is not None:
            turn_request = dataclasses.replace(request.turn, sampling=self.sampling_rule.apply(request.turn.sampling))
            request = dataclasses.replace(request, turn=turn_request)
        if episode is None:
            async with self.endpoint.turn(request.turn) as turn:
                yield Call(request, turn, ResponseBuilder(request, self.tokenizer, turn.trajectory_id),
                           counts=self.counts)
            return
        seat = episode.seat(identity.agent)
        async with contextlib.AsyncExitStack() as stack:
            turn = await self._episode_turn(episode, seat, request.turn, stack)
            yield Call(request, turn, ResponseBuilder(request, self.tokenizer, turn.trajectory_id),
                       on_result=lambda result: seat.replied(self.tokenizer.decode(result.token_ids)),
                       counts=self.counts)

    async def respond(self, body: Any, identity: Identity | None = None) -> tuple[str, dict[str, Any]]:
        """``POST /v1/responses``: the request as a chat turn (`sfhpc.endpoint.responses`); returns the
        trajectory id and the Responses body."""
        async with self.call("chat", responses.to_chat(body), identity) as call:
            return call.trajectory_id, responses.from_chat(await call.response(), body)

    async def _episode_turn(self, episode: OpenEpisode, seat: Seat, request: TurnRequest,
                            stack: contextlib.AsyncExitStack) -> Turn:
        """Open the turn of a call on an episode's (or one of its agents') URL: the agent's first call starts
        its trajectory (under the client's own id, if it named one), every later one continues it."""
        chosen = request.trajectory_id
        if seat.trajectory_id is None:
            # Calls that arrive together must not start two trajectories: the first one starts it, the others
            # wait here and then continue it.
            async with seat.starting:
                if seat.trajectory_id is None:
                    first = dataclasses.replace(request, trajectory_id=None, start_id=chosen, task=episode.task,
                                                group=episode.group, metadata=episode.trajectory_metadata(seat.agent))
                    turn = await stack.enter_async_context(self.endpoint.turn(first))
                    episode.started(seat, turn.trajectory_id)
                    return turn
        episode.check_id(seat, chosen)
        assert seat.trajectory_id is not None
        return await stack.enter_async_context(
            self.endpoint.turn(dataclasses.replace(request, trajectory_id=seat.trajectory_id)))

    def post_reward(self, episode_id: str, body: Any, agent: str = "") -> dict[str, Any]:
        """``POST /episodes/<id>[/agents/<name>]/reward``: the program's own reward for its episode, or for one
        of its agents (the latest one counts)."""
        seat = self.episodes.get(episode_id).seat(agent)
        seat.reward = parse_reward(body)
        return {"episode": episode_id, **({"agent": agent} if agent else {}), "reward": seat.reward}
