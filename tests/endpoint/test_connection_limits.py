"""The HTTP servers' connection limits (`sfhpc.endpoint.server.serve_app`, what the endpoint and agent hosts
serve with): connections that never finish their request (half-open: a partial head) do not keep a normal
request waiting and are closed after the head timeout; at the connection cap the oldest idle connection makes
room; a body that never arrives gets a 408."""

from __future__ import annotations

import asyncio
import selectors
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest
from aiohttp import web

from sfhpc.endpoint import server as server_module
from sfhpc.endpoint.server import HEAD_TIMEOUT_S, IDLE_TIMEOUT_S, ConnectionGuard, _GuardedSite
from tests.endpoint.standalone import standalone

HALF_OPEN = 400
PARTIAL_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl"


def half_open(host: str, port: int, count: int) -> list[socket.socket]:
    sockets = []
    for _ in range(count):
        sock = socket.create_connection((host, port), timeout=5)
        sock.sendall(PARTIAL_HEAD)
        sockets.append(sock)
    return sockets


def wait_closed(sockets: list[socket.socket], within: float) -> int:
    """How many of `sockets` the server closed (EOF or reset) within `within` seconds."""
    selector = selectors.DefaultSelector()
    for sock in sockets:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    closed, deadline = 0, time.monotonic() + within
    while closed < len(sockets) and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=max(0.0, deadline - time.monotonic())):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                data = sock.recv(65536)
            except ConnectionError:
                data = b""
            if not data:  # a server that gives up on a head may answer 408 first; EOF is what counts
                selector.unregister(sock)
                closed += 1
    selector.close()
    return closed


def test_half_open_connections_neither_block_a_request_nor_stay_open() -> None:
    """The issue's acceptance, on the standalone endpoint: with 400 half-open connections a normal request
    answers within 1 s, and they are all closed within 30 s."""
    assert HEAD_TIMEOUT_S <= IDLE_TIMEOUT_S <= 30
    with standalone() as url:
        address = urlparse(url)
        assert address.hostname is not None and address.port is not None
        sockets = half_open(address.hostname, address.port, HALF_OPEN)
        try:
            opened = time.monotonic()
            started = time.monotonic()
            answer = httpx.get(f"{url.removesuffix('/v1')}/health", timeout=5)
            assert answer.status_code == 200 and time.monotonic() - started < 1.0
            reply = httpx.post(f"{url}/chat/completions", timeout=5, json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert reply.status_code == 200 and time.monotonic() - started < 1.0
            closed = wait_closed(sockets, within=30 - (time.monotonic() - opened))
            assert closed == HALF_OPEN, f"{HALF_OPEN - closed} half-open connections still open after 30 s"
            assert time.monotonic() - opened < HEAD_TIMEOUT_S + 10
        finally:
            for sock in sockets:
                sock.close()


async def _serve(app: web.Application, cap: int) -> tuple[web.AppRunner, int, ConnectionGuard]:
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    guard = ConnectionGuard(cap)
    site = _GuardedSite(runner, "127.0.0.1", 0, guard=guard)
    await site.start()
    return runner, site.port, guard


def test_at_the_cap_the_oldest_idle_connection_makes_room_and_busy_ones_are_kept() -> None:
    async def main() -> None:
        release = asyncio.Event()

        async def slow(request: web.Request) -> web.Response:
            await release.wait()
            return web.json_response({"slow": True})

        async def fast(request: web.Request) -> web.Response:
            return web.json_response({"ok": True})

        app = web.Application()
        app.router.add_get("/slow", slow)
        app.router.add_get("/fast", fast)
        runner, port, guard = await _serve(app, cap=8)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
                slow_calls = [asyncio.create_task(client.get("/slow")) for _ in range(3)]  # busy: never evicted
                while len(guard.open) < 3:
                    await asyncio.sleep(0.01)
                idle = await asyncio.to_thread(half_open, "127.0.0.1", port, 20)
                deadline = asyncio.get_running_loop().time() + 10
                while guard.evicted < 3 + 20 - 8 and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.01)  # the server accepts what the backlog holds
                stats = (len(guard.open), guard.evicted, guard.refused, guard.head_timeouts)
                assert stats[:2] == (8, 3 + 20 - 8), stats
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as other:
                    assert (await other.get("/fast")).json() == {"ok": True}
                assert len(guard.open) <= 8 and guard.evicted == 3 + 20 + 1 - 8
                release.set()
                assert [(await call).json() for call in slow_calls] == [{"slow": True}] * 3
                for sock in idle:
                    sock.close()
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_a_new_connection_is_refused_when_every_open_one_serves_a_request() -> None:
    async def main() -> None:
        release = asyncio.Event()

        async def slow(request: web.Request) -> web.Response:
            await release.wait()
            return web.json_response({"slow": True})

        app = web.Application()
        app.router.add_get("/slow", slow)
        runner, port, guard = await _serve(app, cap=2)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
                calls = [asyncio.create_task(client.get("/slow")) for _ in range(2)]
                while len(guard.open) < 2 or any(server_module._idle(c.handler) for c in guard.open):
                    await asyncio.sleep(0.01)
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as other:
                    with pytest.raises(httpx.TransportError):
                        await other.get("/slow")
                assert guard.refused == 1
                release.set()
                assert [(await call).status_code for call in calls] == [200, 200]
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_a_body_that_never_arrives_gets_a_408(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_module, "BODY_TIMEOUT_S", 0.3)
    with standalone_in_process() as port:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\":")
            answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer


class standalone_in_process:
    """The endpoint's app served in this process (so that a test may patch the module's limits)."""

    def __enter__(self) -> int:
        from sfhpc.endpoint import AgentEndpoint, EndpointServer, OpenAIApi
        from sfhpc.engine.scripted import ScriptedEngine
        from tests.endpoint.conftest import RecordingManager

        self.server = EndpointServer(OpenAIApi(AgentEndpoint(ScriptedEngine(), RecordingManager()), model_name="m"))
        self.server.start()
        return self.server.port

    def __exit__(self, *exc_info: object) -> None:
        self.server.stop()
