"""The OpenAI-compatible API of one endpoint, apart from any transport.

The HTTP server and the in-process client both go through `OpenAIApi.call`, so an agent gets the same
validation, trajectory bookkeeping, responses and errors whichever way it connects.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from sfhpc.endpoint.protocol import ApiRequest, Identity, ResponseBuilder, Route, models_body, parse
from sfhpc.endpoint.service import AgentEndpoint, Turn
from sfhpc.engine.tokenizer import ByteTokenizer


class Call:
    """One accepted request: its trajectory is known, the turn is open, the answer not yet produced."""

    def __init__(self, request: ApiRequest, turn: Turn, builder: ResponseBuilder) -> None:
        self.request = request
        self._turn = turn
        self._builder = builder

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
        return self._builder.full(self._turn.result)

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The streamed chunks, without the SSE framing and the closing ``[DONE]``."""
        yield self._builder.first_chunk()
        async for delta in self._turn.stream():
            yield self._builder.delta_chunk(delta)
        result = self._turn.result
        assert result is not None
        yield self._builder.last_chunk(result)
        if self.request.include_usage:
            yield self._builder.usage_chunk(result)


class OpenAIApi:
    """Routes of the OpenAI API over one `AgentEndpoint`, serving one model name.

    `token` is the bearer token every HTTP transport of this API demands (`EndpointServer`,
    `start_site`); the in-process client calls the API directly and needs none.
    """

    def __init__(self, endpoint: AgentEndpoint, *, model_name: str, tokenizer: ByteTokenizer | None = None,
                 token: str | None = None) -> None:
        self.endpoint = endpoint
        self.model_name = model_name
        self.token = token
        self.tokenizer = tokenizer or ByteTokenizer()
        self.created = int(time.time())

    def models(self) -> dict[str, Any]:
        return models_body(self.model_name, self.created)

    def health(self) -> dict[str, Any]:
        engine = self.endpoint.engine
        return {"status": "ok", "model": self.model_name, "engine": engine.name, "version": engine.version,
                "paused": engine.paused}

    @contextlib.asynccontextmanager
    async def call(self, route: Route, body: Any, identity: Identity | None = None) -> AsyncIterator[Call]:
        """Validate `body` and open its turn; raises `EndpointError` before anything is generated."""
        request = parse(route, body, model_name=self.model_name, tokenizer=self.tokenizer,
                        identity=identity or Identity())
        async with self.endpoint.turn(request.turn) as turn:
            yield Call(request, turn, ResponseBuilder(request, self.tokenizer, turn.trajectory_id))
