"""The HTTP server of the agent endpoint (aiohttp): OpenAI routes, bearer-token guard, SSE streaming.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses`` (streamed or not,
`sfhpc.endpoint.responses`), ``GET /v1/models``, ``GET /health``.
The trajectory id travels in the ``X-Trajectory-Id`` header (or the body's ``user`` field) and comes
back in the same header and in the body's ``trajectory_id``; ``X-Task`` / ``X-Group`` label a new
trajectory.

Per-episode routes, for agent programs that know nothing of trajectories (`sfhpc.endpoint.episodes`): the
same OpenAI routes under ``/episodes/<id>/v1/``, every call of which is a turn of that episode's
trajectory without any header, and ``POST /episodes/<id>/reward`` with ``{"reward": x}``; the same under
``/episodes/<id>/agents/<name>/`` for each agent of an episode of several, a trajectory each.

Exposure: the server binds 127.0.0.1 unless told otherwise, and refuses any other address without a
bearer token. Agents on other nodes reach it when it binds an address they can route to (``0.0.0.0``: all
of the node's); the URLs it hands out name `advertise_host` (by default the bound address, or the node's
host name when bound to all addresses).

With a token (a run always gives one: `sfhpc.endpoint.new_run_token`), every request, on every route and on
loopback too, needs ``Authorization: Bearer <token>``; one without it or with another gets a 401 in OpenAI's
error shape.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import socket
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from aiohttp import web

from sfhpc.endpoint import responses
from sfhpc.endpoint.api import OpenAIApi
from sfhpc.endpoint.auth import authorized
from sfhpc.endpoint.errors import (
    BadRequest,
    EndpointConfigError,
    EndpointError,
    MethodNotAllowed,
    NotFound,
    ServerError,
    Unauthorized,
)
from sfhpc.endpoint.protocol import Identity, Route

DEFAULT_HOST = "127.0.0.1"
EPISODE_PREFIX = "/episodes/{episode}"
AGENT_PREFIX = "/episodes/{episode}/agents/{agent}"  # one agent of an episode of several
TRAJECTORY_HEADER = "X-Trajectory-Id"
TASK_HEADER = "X-Task"
GROUP_HEADER = "X-Group"

log = logging.getLogger(__name__)
T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost may resolve to anything
        return False


def advertised(host: str) -> str:
    """The host name that clients use for a server bound to `host`: the node's name for an address that
    stands for all of them (``0.0.0.0``, ``::``), else `host` itself."""
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host


def check_exposure(host: str, token: str | None) -> None:
    if not is_loopback(host) and not token:
        raise EndpointConfigError(f"the agent endpoint would listen on {host}, beyond this machine, without a "
                                  f"token; set a bearer token or bind {DEFAULT_HOST}")


def _token(api: OpenAIApi, token: str | None) -> str | None:
    """The token a transport enforces: the one given, else the API's own (an empty one is none)."""
    return (token if token is not None else api.token) or None


def build_app(api: OpenAIApi, *, token: str | None = None) -> web.Application:
    """The aiohttp application serving `api`; with a token (`token`, else ``api.token``), every request
    must carry it."""
    expected = _token(api, token)

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            # Before routing: without the token a caller learns nothing, not even which routes exist.
            if expected is not None and not authorized(request.headers.get("Authorization"), expected):
                raise Unauthorized("missing or wrong bearer token: send 'Authorization: Bearer <token>' "
                                   "(the openai client's api_key)")
            return await handler(request)
        except EndpointError as exc:
            return _error_response(exc)
        except web.HTTPNotFound:
            return _error_response(NotFound(f"no route {request.method} {request.path}; see GET /v1/models"))
        except web.HTTPMethodNotAllowed:
            return _error_response(MethodNotAllowed(f"{request.method} is not allowed on {request.path}"))
        except web.HTTPException as exc:
            return _error_response(BadRequest(exc.reason or str(exc), code=str(exc.status)))
        except Exception as exc:  # the server keeps serving; the agent gets a JSON 500
            log.exception("agent endpoint: %s %s failed", request.method, request.path)
            return _error_response(ServerError(f"internal error: {type(exc).__name__}: {exc}"))

    def identity(request: web.Request) -> Identity:
        return Identity(trajectory_id=request.headers.get(TRAJECTORY_HEADER) or None,
                        task=request.headers.get(TASK_HEADER, ""), group=request.headers.get(GROUP_HEADER),
                        episode=request.match_info.get("episode"), agent=request.match_info.get("agent", ""))

    async def completion(request: web.Request, route: Route) -> web.StreamResponse:
        body = await _json_body(request)
        async with api.call(route, body, identity(request)) as call:
            headers = {TRAJECTORY_HEADER: call.trajectory_id}
            if not call.stream:
                return web.json_response(await call.response(), headers=headers)
            response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                                   "Cache-Control": "no-cache"})
            await response.prepare(request)
            try:
                try:
                    async for chunk in call.chunks():
                        await response.write(_sse(chunk))
                except EndpointError as exc:  # headers are sent: the error becomes the last event
                    await response.write(_sse(exc.body()))
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
            except ConnectionResetError:  # the agent left; the turn recorded what was generated
                pass
            return response

    async def chat(request: web.Request) -> web.StreamResponse:
        return await completion(request, "chat")

    async def completions(request: web.Request) -> web.StreamResponse:
        return await completion(request, "completions")

    async def respond(request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        if not (isinstance(body, dict) and body.get("stream")):
            trajectory_id, answer = await api.respond(body, identity(request))
            return web.json_response(answer, headers={TRAJECTORY_HEADER: trajectory_id})
        async with api.call("chat", responses.to_chat(body), identity(request)) as call:
            stream = responses.ResponseStream(body, api.model_name)
            response = web.StreamResponse(headers={TRAJECTORY_HEADER: call.trajectory_id,
                                                   "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            try:
                try:
                    async for chunk in call.chunks():
                        for event in stream.events(chunk):
                            await response.write(_sse_event(event))
                    for event in stream.end():
                        await response.write(_sse_event(event))
                except EndpointError as exc:  # headers are sent: the error becomes the last event
                    await response.write(_sse_event(stream.error(exc.body())))
                await response.write_eof()
            except ConnectionResetError:  # the agent left; the turn recorded what was generated
                pass
            return response

    async def models(request: web.Request) -> web.StreamResponse:
        if "episode" in request.match_info:
            api.episodes.get(request.match_info["episode"])  # an ended episode's URL serves nothing
        return web.json_response(api.models())

    async def reward(request: web.Request) -> web.StreamResponse:
        return web.json_response(api.post_reward(request.match_info["episode"], await _json_body(request),
                                                 agent=request.match_info.get("agent", "")))

    async def health(request: web.Request) -> web.StreamResponse:
        return web.json_response(api.health())

    app = web.Application(middlewares=[guard])
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/responses", respond)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    for prefix in (EPISODE_PREFIX, AGENT_PREFIX):
        app.router.add_post(f"{prefix}/v1/chat/completions", chat)
        app.router.add_post(f"{prefix}/v1/completions", completions)
        app.router.add_post(f"{prefix}/v1/responses", respond)
        app.router.add_get(f"{prefix}/v1/models", models)
        app.router.add_post(f"{prefix}/reward", reward)
    return app


async def _json_body(request: web.Request) -> Any:
    raw = await request.read()
    try:
        # NaN and the infinities are decoded, not refused here: the decoder cannot say in which field it
        # met them, and `sfhpc.endpoint.fields` refuses them naming the field.
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc


def _sse_event(event: dict[str, Any]) -> bytes:
    """One event of the Responses API's stream: its type named on the ``event:`` line too."""
    return f"event: {event['type']}\n".encode() + _sse(event)


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _error_response(exc: EndpointError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


async def start_site(api: OpenAIApi, *, host: str = DEFAULT_HOST, port: int = 0,
                     token: str | None = None) -> tuple[web.AppRunner, int]:
    """Serve `api` on the running loop; returns the runner (``await runner.cleanup()`` stops it) and the
    port (the chosen one when `port` is 0). The token is `token`, else ``api.token``."""
    token = _token(api, token)
    check_exposure(host, token)
    # A closing rank gives open requests 5 s, then cancels them (their tokens are recorded already):
    # aiohttp's default of 60 s would hold a stopping rank past a preemption's grace.
    runner = web.AppRunner(build_app(api, token=token), access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise EndpointConfigError(f"the agent endpoint cannot listen on {host}:{port}: {exc.strerror}; "
                                  f"choose another port (0 picks a free one)") from exc
    server = site._server  # aiohttp keeps the listening sockets there
    # (typed AbstractServer, which has no `sockets`; the loop's server, asyncio's or uvloop's, has them)
    bound = server.sockets[0].getsockname()[1] if server is not None and server.sockets else port  # type: ignore[attr-defined]
    return runner, bound


class EndpointServer:
    """Runs the HTTP server on its own event loop in a background thread.

    The engine and the `AgentEndpoint` behind `api` live on that loop; other threads reach them with
    `call` (e.g. ``server.call(endpoint.update_weights(...))``). With a token (`token`, else ``api.token``)
    every request must carry it; agents pass `token` as their ``api_key``.
    """

    def __init__(self, api: OpenAIApi, *, host: str = DEFAULT_HOST, port: int = 0, token: str | None = None,
                 advertise_host: str | None = None) -> None:
        token = _token(api, token)
        check_exposure(host, token)
        self.api = api
        self.host, self.port, self.token = host, port, token
        self.advertise_host = advertise_host or advertised(host)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="sfhpc-endpoint", daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        """Base URL of the OpenAI API (what an agent passes as ``base_url``)."""
        return f"{self._origin()}/v1"

    def episode_url(self, episode_id: str) -> str:
        """The base URL of one episode (an agent program's ``OPENAI_BASE_URL``)."""
        return f"{self._origin()}/episodes/{episode_id}/v1"

    def _origin(self) -> str:
        host = f"[{self.advertise_host}]" if ":" in self.advertise_host else self.advertise_host
        return f"http://{host}:{self.port}"

    def start(self) -> EndpointServer:
        self._thread.start()
        self._runner, self.port = self.call(start_site(self.api, host=self.host, port=self.port, token=self.token))
        return self

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the server's loop and return its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close_site(self) -> None:
        """Stop accepting HTTP requests and finish the open ones; the event loop keeps running."""
        if self._runner is not None:
            self.call(self._runner.cleanup(), timeout=30)
            self._runner = None

    def stop(self) -> None:
        self.close_site()
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)
        if not self.loop.is_running():
            self.loop.close()

    def __enter__(self) -> EndpointServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
