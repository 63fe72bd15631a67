"""The HTTP server of the agent endpoint (aiohttp): OpenAI routes, bearer-token guard, SSE streaming.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses`` (streamed or not,
`sfhpc.endpoint.responses`), ``GET /v1/models``, ``GET /health``.
The trajectory id travels in the ``X-Trajectory-Id`` header (or the body's ``user`` field) and comes
back in the same header and in the body's ``trajectory_id``; ``X-Task`` / ``X-Group`` label a new
trajectory.

Per-episode routes, for agent programs that know nothing of trajectories (`sfhpc.endpoint.episodes`): the
same OpenAI routes under ``/episodes/<id>/v1/``, every call of which is a turn of that episode's
trajectory without any header, and ``POST /episodes/<id>/reward`` with ``{"reward": x}`` (taken only where
the episode takes posted rewards; else 403 and counted); the same under ``/episodes/<id>/agents/<name>/``
for each agent of an episode of several, a trajectory each. An episode's key opens its own routes alone.

Exposure: the server binds 127.0.0.1 unless told otherwise, and refuses any other address without a
bearer token. Agents on other nodes reach it when it binds an address they can route to (``0.0.0.0``: all
of the node's); the URLs it hands out name `advertise_host` (by default the bound address, or the node's
host name when bound to all addresses).

With a token (a run always gives one: `sfhpc.endpoint.new_run_token`), every request, on every route and on
loopback too, needs ``Authorization: Bearer <token>``; one without it or with another gets a 401 in OpenAI's
error shape.

Connections (`serve_app`, also what agent hosts serve with): a request's head must arrive whole within
`HEAD_TIMEOUT_S` of the connection opening (or of its first byte on a kept-alive connection) and its body
within `BODY_TIMEOUT_S`; an idle kept-alive connection closes after `IDLE_TIMEOUT_S`; at most
`max_connections()` are open at once: at the cap a new connection closes the oldest one that has no request
in progress, and is itself refused when every open one is serving a request.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import resource
import socket
import threading
import time
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

# Connection limits of the HTTP servers (the endpoint, agent hosts), against clients that connect and never
# finish (a slowloris, a scanner, a client frozen mid-request) and would otherwise hold a socket each for
# minutes. A client on a cluster network writes a request's head (a few hundred bytes) at once: 10 s only
# ends connections that stalled, and a client that hangs up retries.
HEAD_TIMEOUT_S = 10.0
# An idle kept-alive connection closes after this long: longer than the clients' own idle limits (httpx under the
# openai client drops its idle connections after 5 s, aiohttp's client after 15 s), so a client always lets go of
# an idle connection first and never reuses one the server is closing; short enough that abandoned connections
# do not pile up. (aiohttp's keep-alive timer; it also closes a connection that never sent a byte.)
IDLE_TIMEOUT_S = 20.0
# A request's body, once its head arrived: up to the 1 MiB aiohttp accepts, milliseconds on any network.
BODY_TIMEOUT_S = 30.0
# Open connections at most (also at most half the process's file descriptors, see `max_connections`): well
# above the agents a rank or host serves at once, each of which holds one connection per call in flight.
MAX_CONNECTIONS = 1024

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
        episode = _episode_of(request.path)
        try:
            # Before routing: without a key a caller learns nothing, not even which routes exist. The run's
            # token opens every route; an episode's key (its program's) opens that episode's alone.
            header = request.headers.get("Authorization")
            if expected is not None and not authorized(header, expected) and not api.episodes.check_key(
                    (header or "").removeprefix("Bearer "), episode):
                raise Unauthorized("missing or wrong bearer token: send 'Authorization: Bearer <token>' "
                                   "(the openai client's api_key)")
            return await handler(request)
        except EndpointError as exc:
            if episode is not None:  # an episode that gets no reply fails naming this
                api.episodes.refused(episode, exc)
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


def _episode_of(path: str) -> str | None:
    """The episode id of an episode's route (``/episodes/<id>/...``), else None."""
    parts = path.split("/", 3)
    return parts[2] if len(parts) > 3 and parts[1] == "episodes" and parts[2] else None


class RequestTimeout(EndpointError):
    status = 408
    default_code = "request_timeout"


async def _json_body(request: web.Request) -> Any:
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            raw = await request.read()
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {BODY_TIMEOUT_S:g} s") from None
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
    try:
        # A closing rank gives open requests 5 s, then cancels them (their tokens are recorded already):
        # aiohttp's default of 60 s would hold a stopping rank past a preemption's grace.
        return await serve_app(build_app(api, token=token), host=host, port=port, shutdown_timeout=5.0)
    except OSError as exc:
        raise EndpointConfigError(f"the agent endpoint cannot listen on {host}:{port}: {exc.strerror}; "
                                  f"choose another port (0 picks a free one)") from exc


async def serve_app(app: web.Application, *, host: str, port: int = 0, shutdown_timeout: float = 5.0,
                    connections: int | None = None) -> tuple[web.AppRunner, int]:
    """Serve `app` on the running loop at `host`:`port` with the connection limits of the module doc (the
    endpoint's and the agent hosts' one way to serve); returns the runner (``await runner.cleanup()`` stops
    it) and the bound port. `connections`: the cap (default `max_connections()`). Raises OSError when the
    address cannot be bound."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout, keepalive_timeout=IDLE_TIMEOUT_S)
    await runner.setup()
    site = _GuardedSite(runner, host, port, guard=ConnectionGuard(connections or max_connections()))
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    return runner, site.port


def max_connections() -> int:
    """`MAX_CONNECTIONS`, or half the process's file descriptors if fewer: the other half stays for the
    store, the engine, the agent programs' pipes."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MAX_CONNECTIONS if soft == resource.RLIM_INFINITY else max(16, min(MAX_CONNECTIONS, soft // 2))


def _idle(handler: asyncio.Protocol) -> bool:
    """Whether an aiohttp connection has no request in progress: none being handled or answered
    (``RequestHandler._request_in_progress``) and no whole head waiting to be (``_messages``); a connection
    still sending a head, or not started yet, is idle. Should aiohttp rename these, every connection counts as
    busy: none is closed for being idle, and aiohttp's own keep-alive timer still ends idle ones."""
    if not (hasattr(handler, "_request_in_progress") and hasattr(handler, "_messages")):
        return False
    return not handler._request_in_progress and not handler._messages


def _heads(handler: asyncio.Protocol) -> int:
    """Request heads an aiohttp connection has received whole so far (-1: unknown)."""
    return int(getattr(handler, "_request_count", -1))


class ConnectionGuard:
    """The connections of one server: each gets `HEAD_TIMEOUT_S` for a request's head, and at most `cap`
    are open (see the module doc). Counts what it closed, for tests and logs."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.open: dict[_GuardedConnection, None] = {}  # in order of arrival: the first idle one is the oldest
        self.head_timeouts = self.evicted = self.refused = 0
        self._warned = 0.0

    def admit(self, connection: _GuardedConnection) -> bool:
        if len(self.open) >= self.cap:
            oldest_idle = next((c for c in self.open if _idle(c.handler)), None)
            if oldest_idle is None:
                self.refused += 1
                self._warn(f"{self.cap} connections are serving requests; a new one was refused")
                return False
            self.evicted += 1
            self._warn(f"{self.cap} connections are open; the oldest idle one was closed for a new one")
            oldest_idle.close()
        self.open[connection] = None
        return True

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._warned > 60:  # once a minute: a flood of connections must not flood the log
            self._warned = now
            log.warning("HTTP server: %s (evicted %d, refused %d so far)", message, self.evicted, self.refused)


class _GuardedConnection(asyncio.Protocol):
    """An aiohttp connection (its `RequestHandler`, to which every event goes) under a `ConnectionGuard`."""

    def __init__(self, guard: ConnectionGuard, handler: asyncio.Protocol) -> None:
        self.guard, self.handler = guard, handler
        self.admitted = False
        self._timer: asyncio.TimerHandle | None = None
        self._heads_at_timer = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self.guard.admit(self):
            assert isinstance(transport, asyncio.Transport)  # a TCP server's
            transport.abort()
            return
        self.admitted = True
        self.handler.connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if not self.admitted:
            return
        if self._timer is None and _idle(self.handler):
            self._arm()  # the first bytes of a request on a kept-alive connection: its head has HEAD_TIMEOUT_S
        self.handler.data_received(data)
        if self._timer is not None and _heads(self.handler) != self._heads_at_timer:
            self._disarm()  # the head came whole

    def eof_received(self) -> bool | None:
        return self.handler.eof_received() if self.admitted else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.guard.open.pop(self, None)
        if self.admitted:
            self.handler.connection_lost(exc)

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()

    def close(self) -> None:
        self._disarm()
        self.guard.open.pop(self, None)
        force_close = getattr(self.handler, "force_close", None)
        if force_close is not None:
            force_close()

    def _arm(self) -> None:
        self._heads_at_timer = _heads(self.handler)
        self._timer = asyncio.get_running_loop().call_later(HEAD_TIMEOUT_S, self._head_overdue)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_overdue(self) -> None:
        self._timer = None
        if _heads(self.handler) == self._heads_at_timer and _idle(self.handler):
            self.guard.head_timeouts += 1
            self.close()


class _GuardedSite(web.TCPSite):
    """aiohttp's TCP site, its connections under a `ConnectionGuard`."""

    __slots__ = ("guard",)

    def __init__(self, runner: web.AppRunner, host: str, port: int, *, guard: ConnectionGuard) -> None:
        super().__init__(runner, host, port)
        self.guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner (what TCPSite.start begins with)
        server = self._runner.server
        assert server is not None
        guard = self.guard
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _GuardedConnection(guard, server()), self._host, self._port, backlog=self._backlog)
        sockets = getattr(self._server, "sockets", None)
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port


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
