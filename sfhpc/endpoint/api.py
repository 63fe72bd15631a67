"""The OpenAI-compatible API of one endpoint, apart from any transport.

The HTTP server and the in-process client both go through `OpenAIApi.call`, so an agent gets the same
validation, trajectory bookkeeping, responses and errors whichever way it connects.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from sfhpc.endpoint import responses
from sfhpc.endpoint.episodes import Episodes, OpenEpisode, Seat
from sfhpc.endpoint.errors import BadRequest, Forbidden
from sfhpc.endpoint.history import RecordedContexts
from sfhpc.endpoint.protocol import ApiRequest, Identity, ResponseBuilder, Route, models_body, parse, read_calls
from sfhpc.endpoint.service import AgentEndpoint, SamplingRule, Turn, TurnRequest
from sfhpc.endpoint.tools import read_tools
from sfhpc.engine.tokenizer import ByteTokenizer, ChatTokenizer

log = logging.getLogger(__name__)


class Call:
    """One accepted request: its trajectories are known, the turns are open (one per choice, ``n``), the answer
    not yet produced."""

    def __init__(self, request: ApiRequest, turns: list[Turn], builders: list[ResponseBuilder],
                 on_result: Callable[[Turn], None] | None = None,
                 counts: collections.Counter[str] | None = None) -> None:
        self.request = request
        self._turns = turns
        self._builders = builders
        self._on_result = on_result
        self._counts = counts

    def _done(self, turn: Turn) -> None:
        if self._on_result is not None:
            self._on_result(turn)

    def _read(self, builder: ResponseBuilder) -> None:
        """Count what a reply held for the tools offered and the format asked (once its response is built)."""
        if self._counts is None:
            return
        parsed = builder.parsed
        if parsed is not None:
            self._counts["tool_calls"] += len(parsed.calls)
            if parsed.failed:
                self._counts["tool_call_parse_failures"] += 1
                log.warning("trajectory %s: a reply began a tool call that does not parse; returned as content",
                            builder.trajectory_id)
            if parsed.unoffered:
                self._counts["tool_calls_unoffered"] += 1
                log.warning("trajectory %s: a reply called %s, which the request did not offer; returned as content",
                            builder.trajectory_id, ", ".join(parsed.unoffered))
        reply_format = self.request.response_format
        if reply_format is not None and not (parsed is not None and parsed.calls):
            miss = reply_format.miss(builder.content)
            if miss is not None:
                self._counts["response_format_misses"] += 1
                log.warning("trajectory %s: a reply asked for in JSON is %s", builder.trajectory_id, miss)

    @property
    def trajectory_id(self) -> str:
        """The first choice's trajectory (the only one unless the request asked for ``n > 1``)."""
        return self._turns[0].trajectory_id

    @property
    def stream(self) -> bool:
        return self.request.stream

    async def response(self) -> dict[str, Any]:
        """The whole response body (for ``stream: false``): the choices generate together."""
        async def run(turn: Turn, builder: ResponseBuilder) -> dict[str, Any]:
            async for _ in turn.stream():
                pass
            assert turn.result is not None
            self._done(turn)
            body = builder.full(turn.result)
            self._read(builder)
            return body

        bodies = await asyncio.gather(*(run(t, b) for t, b in zip(self._turns, self._builders)))
        if len(bodies) == 1:
            return bodies[0]
        # One body, one choice per trajectory (each naming its own); usage counts the prompt once.
        body = dict(bodies[0])
        body["choices"] = [{**b["choices"][0], "index": i, "trajectory_id": b["trajectory_id"]}
                           for i, b in enumerate(bodies)]
        completion = sum(b["usage"]["completion_tokens"] for b in bodies)
        prompt = body["usage"]["prompt_tokens"]
        body["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        return body

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The streamed chunks, without the SSE framing and the closing ``[DONE]`` (one choice: a request
        that asks for several is not streamed, `sfhpc.endpoint.protocol.parse`)."""
        [turn], [builder] = self._turns, self._builders
        yield builder.first_chunk(turn.request.prompt_token_ids)
        async for delta in turn.stream():
            yield builder.delta_chunk(delta)
        result = turn.result
        assert result is not None
        self._done(turn)
        for chunk in builder.last_chunks(result):
            yield chunk
        self._read(builder)
        if self.request.include_usage:
            yield builder.usage_chunk(result)


class OpenAIApi:
    """Routes of the OpenAI API over one `AgentEndpoint`, serving one model name.

    `token` is the bearer token every HTTP transport of this API demands (`EndpointServer`,
    `start_site`); the in-process client calls the API directly and needs none. `episodes` are the open
    per-episode URLs (see `sfhpc.endpoint.episodes`). With a `sampling_rule` (an RL run's), a turn that asks
    for no temperature gets the run's default, and sampling the trainer cannot match is refused.
    `tool_parser` names the format of the model's tool calls (by default the one its chat template writes).
    `max_n` is the most choices (``n``) one call may ask for; each is a trajectory of its own.
    `counts` holds what the replies held: ``tool_calls`` read, ``tool_call_parse_failures`` (replies that
    began a call that does not parse, returned as content), ``tool_calls_unoffered`` (replies that called a
    function the request did not offer, returned as content), ``response_format_misses`` (replies not in the
    JSON format their call asked for, `sfhpc.endpoint.response_format`); ``GET /health`` shows them.
    """

    def __init__(self, endpoint: AgentEndpoint, *, model_name: str, tokenizer: ChatTokenizer | None = None,
                 token: str | None = None, sampling_rule: SamplingRule | None = None,
                 tool_parser: str | None = None, max_n: int = 8) -> None:
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
        self.max_n = max_n
        self.counts: collections.Counter[str] = collections.Counter()
        self.history = RecordedContexts(self.tokenizer)

    def models(self) -> dict[str, Any]:
        return models_body(self.model_name, self.created)

    def health(self) -> dict[str, Any]:
        engine = self.endpoint.engine
        return {"status": "ok", "model": self.model_name, "engine": engine.name, "version": engine.version,
                "paused": engine.paused, "tool_calls": self.counts["tool_calls"],
                "tool_call_parse_failures": self.counts["tool_call_parse_failures"],
                "tool_calls_unoffered": self.counts["tool_calls_unoffered"],
                "response_format_misses": self.counts["response_format_misses"],
                "history_respelled": self.history.respelled,
                "turns_refused_after_move": self.endpoint.refused_after_hand_off,
                "rewards_refused": self.episodes.rewards_refused}

    @contextlib.asynccontextmanager
    async def call(self, route: Route, body: Any, identity: Identity | None = None) -> AsyncIterator[Call]:
        """Validate `body` and open its turn; raises `EndpointError` before anything is generated."""
        identity = identity or Identity()
        episode = None if identity.episode is None else self.episodes.get(identity.episode)
        request = parse(route, body, model_name=self.model_name, tokenizer=self.tokenizer, identity=identity,
                        tool_parser=self.tool_parser, max_n=self.max_n)
        if self.sampling_rule is not None:
            group = request.turn.group if episode is None else episode.group
            turn_request = dataclasses.replace(request.turn,
                                               sampling=self.sampling_rule.apply(request.turn.sampling, group))
            request = dataclasses.replace(request, turn=turn_request)
        seat = None if episode is None else episode.seat(identity.agent)

        def on_result(turn: Turn) -> None:
            result = turn.result
            assert result is not None
            self.history.replied(turn.trajectory_id, result.prompt_token_ids, result.token_ids)
            if seat is not None:
                seat.replied(turn.trajectory_id, self.tokenizer.decode(result.token_ids))

        async with contextlib.AsyncExitStack() as stack:
            if episode is None or seat is None:
                turns = await self._turns(request, identity, stack)
            else:
                turns = await self._episode_turns(episode, seat, request, stack)
            yield Call(request, turns, [ResponseBuilder(request, self.tokenizer, t.trajectory_id) for t in turns],
                       on_result=on_result, counts=self.counts)

    def reply_message(self, token_ids: Sequence[int], tools: Sequence[dict[str, Any]] | None) -> dict[str, Any]:
        """The assistant message a reply of `token_ids` is sent as by a call that offers `tools` (for a reply
        replayed to its agent after a restart, `sfhpc.rl.rollout_worker`)."""
        tool_request = read_tools({"tools": list(tools)}, template=self.tokenizer.chat_template,
                                  parser_name=self.tool_parser) if tools else None
        if tool_request is None or tool_request.parser is None:
            return {"role": "assistant", "content": self.tokenizer.decode(token_ids)}
        stops = set(self.tokenizer.chat_stop_ids)  # decoded as a reply that offers tools is (`ResponseBuilder`)
        text = self.tokenizer.decode([t for t in token_ids if t not in stops], skip_special=False)
        parsed, calls = read_calls(tool_request.parser, text)
        return {"role": "assistant", "content": parsed.content, **({"tool_calls": calls} if calls else {})}

    async def respond(self, body: Any, identity: Identity | None = None) -> tuple[str, dict[str, Any]]:
        """``POST /v1/responses``: the request as a chat turn (`sfhpc.endpoint.responses`); returns the
        trajectory id and the Responses body."""
        async with self.call("chat", responses.to_chat(body), identity) as call:
            return call.trajectory_id, responses.from_chat(await call.response(), body)

    async def _turns(self, request: ApiRequest, identity: Identity, stack: contextlib.AsyncExitStack) -> list[Turn]:
        """The turns of a call outside an episode: its own, and with ``n > 1`` a new trajectory per extra
        choice, all in one group (the request's ``X-Group``, else one of their own)."""
        if request.n == 1:
            turn_request, tid = request.turn, request.turn.trajectory_id
            if tid is not None:
                turn_request = self._continuing(tid, turn_request)
            return [await stack.enter_async_context(self.endpoint.turn(turn_request))]
        if request.turn.trajectory_id is not None:
            raise BadRequest("'n' above 1 starts a conversation, or continues one on an episode's URL; this call "
                             "names a trajectory outside an episode", param="n")
        start = dataclasses.replace(request.turn, group=identity.group or f"choices-{uuid.uuid4().hex}")
        return [await stack.enter_async_context(self.endpoint.turn(start)) for _ in range(request.n)]

    async def _episode_turns(self, episode: OpenEpisode, seat: Seat, request: ApiRequest,
                             stack: contextlib.AsyncExitStack) -> list[Turn]:
        """The turns of a call on an episode's (or one of its agents') URL: the agent's first call starts its
        trajectory (under the client's own id, if it named one), a later one continues the trajectory its
        history holds; each extra choice (``n > 1``) starts a trajectory of its own in the episode."""
        turn_request, chosen = request.turn, request.turn.trajectory_id
        turns: list[Turn] = []
        if not seat.trajectories:
            # Calls that arrive together must not start two trajectories: the first one starts it, the others
            # wait here and then continue it.
            async with seat.starting:
                if not seat.trajectories:
                    first = dataclasses.replace(turn_request, trajectory_id=None, start_id=chosen, task=episode.task,
                                                group=episode.group, metadata=episode.trajectory_metadata(seat))
                    turns.append(await stack.enter_async_context(self.endpoint.turn(first)))
                    episode.started(seat, turns[0].trajectory_id)
        if not turns:
            episode.check_id(seat, chosen)
            tid = chosen or seat.continued_by(turn_request.prompt_token_ids, self.history.get)
            turns.append(await stack.enter_async_context(self.endpoint.turn(self._continuing(tid, turn_request))))
        for _ in range(request.n - 1):
            extra = dataclasses.replace(turn_request, trajectory_id=None, start_id=None, task=episode.task,
                                        group=episode.group, metadata=episode.trajectory_metadata(seat))
            turns.append(await stack.enter_async_context(self.endpoint.turn(extra)))
            episode.started(seat, turns[-1].trajectory_id)
        return turns

    def _continuing(self, trajectory_id: str, request: TurnRequest) -> TurnRequest:
        """The turn that continues `trajectory_id`: the history, if it is the recorded one spelled with
        other tokens, continues the recorded tokens (`sfhpc.endpoint.history`)."""
        prompt = self.history.prompt(trajectory_id, request.prompt_token_ids)
        return dataclasses.replace(request, trajectory_id=trajectory_id, prompt_token_ids=prompt)

    def post_reward(self, episode_id: str, body: Any, agent: str = "") -> dict[str, Any]:
        """``POST /episodes/<id>[/agents/<name>]/reward``: the program's own reward for its episode, or for one
        of its agents (the latest one counts)."""
        try:
            reward = self.episodes.post_reward(episode_id, agent, body)
        except Forbidden:
            log.warning("agent endpoint: the agent program of episode %s posted a reward, refused (agent."
                        "reward_source is not post)", episode_id)
            raise
        return {"episode": episode_id, **({"agent": agent} if agent else {}), "reward": reward}
