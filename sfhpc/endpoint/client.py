"""In-process clients for Python agents: the endpoint's API without HTTP.

Requests are the same JSON-shaped keyword arguments an OpenAI client sends, responses the same dicts
the HTTP server returns, and refusals raise the same `EndpointError` (``.status``, ``.body()``) an HTTP
agent reads as a 4xx. A trajectory id goes in ``trajectory_id=`` (the header's role) or ``user=``;
``episode=`` makes the call one on that episode's URL (`sfhpc.endpoint.episodes`).

- `AsyncLocalClient`: for agents that are coroutines on the endpoint's own event loop.
- `LocalClient`: for agents in other threads; it runs each call on the endpoint's loop (e.g.
  ``LocalClient(server.api, server.loop)`` next to an `EndpointServer`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

from sfhpc.endpoint.api import OpenAIApi
from sfhpc.endpoint.protocol import Identity, Route

T = TypeVar("T")


class AsyncLocalClient:
    def __init__(self, api: OpenAIApi) -> None:
        self.api = api

    async def chat(self, *, trajectory_id: str | None = None, task: str = "", group: str | None = None,
                   episode: str | None = None, **body: Any) -> dict[str, Any]:
        """``POST /v1/chat/completions`` with ``stream`` false; `body` holds the request fields."""
        return await self._call("chat", body, Identity(trajectory_id, task, group, episode))

    async def complete(self, *, trajectory_id: str | None = None, task: str = "", group: str | None = None,
                       episode: str | None = None, **body: Any) -> dict[str, Any]:
        """``POST /v1/completions`` with ``stream`` false."""
        return await self._call("completions", body, Identity(trajectory_id, task, group, episode))

    def chat_stream(self, *, trajectory_id: str | None = None, task: str = "", group: str | None = None,
                    episode: str | None = None, **body: Any) -> AsyncIterator[dict[str, Any]]:
        """The chunks a streamed chat completion sends (without ``[DONE]``)."""
        return self._stream("chat", body, Identity(trajectory_id, task, group, episode))

    def complete_stream(self, *, trajectory_id: str | None = None, task: str = "", group: str | None = None,
                        episode: str | None = None, **body: Any) -> AsyncIterator[dict[str, Any]]:
        return self._stream("completions", body, Identity(trajectory_id, task, group, episode))

    def models(self) -> dict[str, Any]:
        return self.api.models()

    async def _call(self, route: Route, body: dict[str, Any], identity: Identity) -> dict[str, Any]:
        async with self.api.call(route, {**body, "stream": False}, identity) as call:
            return await call.response()

    async def _stream(self, route: Route, body: dict[str, Any], identity: Identity) -> AsyncIterator[dict[str, Any]]:
        async with self.api.call(route, {**body, "stream": True}, identity) as call:
            async for chunk in call.chunks():
                yield chunk


class LocalClient:
    """Blocking twin of `AsyncLocalClient` for agents in threads other than the endpoint's loop."""

    def __init__(self, api: OpenAIApi, loop: asyncio.AbstractEventLoop) -> None:
        self._client = AsyncLocalClient(api)
        self._loop = loop

    def chat(self, **kwargs: Any) -> dict[str, Any]:
        return self._run(self._client.chat(**kwargs))

    def complete(self, **kwargs: Any) -> dict[str, Any]:
        return self._run(self._client.complete(**kwargs))

    def chat_stream(self, **kwargs: Any) -> Iterator[dict[str, Any]]:
        return self._iterate(self._client.chat_stream(**kwargs))

    def complete_stream(self, **kwargs: Any) -> Iterator[dict[str, Any]]:
        return self._iterate(self._client.complete_stream(**kwargs))

    def models(self) -> dict[str, Any]:
        return self._client.models()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _iterate(self, chunks: AsyncIterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        async def next_chunk() -> dict[str, Any]:
            return await chunks.__anext__()

        try:
            while True:
                try:
                    yield self._run(next_chunk())
                except StopAsyncIteration:
                    return
        finally:
            self._run(chunks.aclose())  # type: ignore[attr-defined]
