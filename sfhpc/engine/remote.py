"""Generation on another rank's engine: how an agent program's episode moves while the program stays.

An agent program holds HTTP connections to its rank's endpoint and keeps its own state (its conversation, its
tools' sandboxes) in its own process: neither can move to another rank. What can move is the generation. When
the controller moves such an episode (a reclaim, a rebalance), the endpoint that serves the program routes the
episode's turns to a `RemoteEngine` (`AgentEndpoint.route`): the turn running now is cut at a token boundary on
the rank's own engine, its tokens recorded, and it continues from that prefix on the rank the controller named,
as a turn continues on a replacement engine; later turns go there too. The program notices nothing: its call
just streams from elsewhere. Every token is recorded where the program's endpoint is, with the version and the
name of the engine that produced it.

Each rank that takes such generations opens a `GenerationDoor` (`sfhpc.door.Door`: a TCP listener with a key
of its own, registered in the run folder, mode 0600), so only the run's user connects. One connection carries
one generation at a time: the request goes in; its chunks stream back as the engine makes them; the end says
whether the door's engine paused under it (a weight update there), which the remote engine counts as a pause
of its own so that the turn continues, as it does across a local pause. A door whose rank takes no more turns
(taken back from rollout, stopping) or whose engine died answers ``gone``: the turn's generation goes back to
its own rank's engine (`RemoteEngine.gone`), from its prefix again, and so do the later turns of every episode
routed there. A rank lent again later is reached through a new `RemoteEngine`.

`multiprocessing.connection` over a socket rather than the MPI world: a lent trainer rank that is taken back
trains in its main thread while its endpoint goes on serving its programs, and the world's communicators are
the main threads' (`sfhpc.runtime.comm_layout`); the rollout workers of other jobs are outside the world.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import os
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from sfhpc.door import Door, knock
from sfhpc.engine.base import EngineStateError, GenerationChunk, GenerationRequest, RolloutEngine
from sfhpc.errors import SfhpcError

log = logging.getLogger("sfhpc")
KNOCK_TIMEOUT_S = 30.0  # a door is registered when its rank's engine started: long before any episode moves
POLL_S = 0.05  # how often a door's thread looks for a requester that went away while its generation runs


def door_name(rank: int) -> str:
    return f"engine-{rank}"


class GenerationDoor:
    """Serves generations of other ranks' episodes on this rank's engine (see the module).

    `loop` is the endpoint's event loop; `running_engine()` (a coroutine on it) returns this rank's engine once
    it is not paused, or raises when the rank takes no more turns."""

    def __init__(self, register: Path, rank: int, loop: asyncio.AbstractEventLoop,
                 running_engine: Callable[[], Awaitable[RolloutEngine]], engine_name: Callable[[], str]) -> None:
        self._loop, self._running_engine, self._engine_name = loop, running_engine, engine_name
        self.served = 0  # generations served, for the rank's log
        self._ids = itertools.count()
        self.door = Door(register, door_name(rank), lambda connection: threading.Thread(
            target=self._serve, args=(connection,), name="sfhpc-generation-door", daemon=True).start())

    def close(self) -> None:
        self.door.close()

    def _serve(self, connection: Connection) -> None:
        with contextlib.closing(connection):
            try:
                connection.send(("hello", self._engine_name()))  # what the requester records its tokens under
                pending = None
                while True:
                    kind, request = pending if pending is not None else connection.recv()
                    pending = None
                    if kind != "generate":
                        raise SfhpcError(f"unknown request {kind!r}")
                    streaming = asyncio.run_coroutine_threadsafe(self._stream(connection, request), self._loop)
                    while not streaming.done():
                        if not connection.poll(POLL_S):
                            continue
                        try:  # the next request, sent the moment this one's end arrived; or the requester's close
                            pending = connection.recv()
                        except (EOFError, OSError):
                            streaming.cancel()  # the requester ended the generation early (its turn was cut)
                            return
                        break
                    streaming.result()
            except (EOFError, OSError, asyncio.CancelledError, concurrent.futures.CancelledError):
                return  # the requester went, or ended its generation early

    async def _stream(self, connection: Connection, request: GenerationRequest) -> None:
        """Run `request` on this rank's engine and send its chunks as they come (small messages: sent from the
        loop; a requester that stops reading blocks nothing but its own stream's socket buffer first)."""
        try:
            engine = await self._running_engine()
        except SfhpcError as exc:  # the rank takes no more turns: the requester generates elsewhere
            connection.send(("gone", str(exc)))
            return
        epoch = engine.pauses
        # An id of this door's own: the requester's are its endpoint's, which this rank's endpoint uses too.
        request = dataclasses.replace(request, request_id=f"door-{next(self._ids)}")
        try:
            async for chunk in engine.generate(request):
                connection.send(("chunk", chunk))
        except (OSError, asyncio.CancelledError):
            raise  # the requester went
        except Exception as exc:  # noqa: BLE001 (the engine died under it: the requester generates at home)
            connection.send(("gone", f"engine '{engine.name}': {type(exc).__name__}: {exc}"))
            return
        self.served += 1
        connection.send(("end", engine.paused or engine.pauses != epoch))


class RemoteEngine(RolloutEngine):
    """The engine of rank `rank`, reached through its `GenerationDoor` in `register`. `max_model_len` is the
    policy's (the same model on every rank). It generates only: its weights are its own rank's to load."""

    def __init__(self, register: Path, rank: int, *, max_model_len: int,
                 on_gone: Callable[[], None] | None = None) -> None:
        super().__init__(f"rank-{rank}")
        self.register, self.rank = register, rank
        self._max_model_len = max_model_len
        self._on_gone = on_gone  # called once, on the loop, when the door answers no more
        self._idle: list[_Channel] = []
        self._busy: dict[str, _Channel] = {}
        self.gone: str | None = None  # why the door answers no more (its rank stopped taking turns); None: open

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        cut = GenerationChunk(request.request_id, (), (), (), "abort")
        if self.gone is not None:
            yield cut
            return
        try:
            channel = self._idle.pop() if self._idle else await self._open()
        except (SfhpcError, OSError) as exc:
            self._went(str(exc))
            yield cut
            return
        self._busy[request.request_id] = channel
        finished = False
        try:
            try:
                channel.send(("generate", request))
            except OSError as exc:  # a pooled connection whose door closed meanwhile
                self._went(f"the connection broke ({exc})")
                yield cut
                return
            while True:
                kind, body = await channel.next()
                if kind == "chunk":
                    finished = finished or body.finish_reason is not None
                    yield GenerationChunk(request.request_id, body.token_ids, body.logprobs, body.versions,
                                          body.finish_reason)
                    continue
                if kind == "end":  # body: the door's engine paused under it, a pause here too (the turn continues)
                    self._pauses += bool(body)
                    if finished:
                        return
                elif kind == "gone":
                    self._went(body)
                # Cut here (an abort, a pause: the connection closed) or there (its rank went): said once, at the end.
                finished = False
                yield cut
                return
        finally:
            self._busy.pop(request.request_id, None)
            if finished and self.gone is None:
                self._idle.append(channel)
            else:
                channel.close()  # an early end: the door cancels the generation on its engine

    async def _open(self) -> _Channel:
        channel = await _Channel.open(self.register, self.rank)
        try:
            kind, name = await asyncio.wait_for(channel.next(), KNOCK_TIMEOUT_S)
        except TimeoutError:
            kind, name = "silent", f"no word within {KNOCK_TIMEOUT_S:g} s"
        if kind != "hello":
            channel.close()
            raise SfhpcError(f"the engine door of rank {self.rank} did not answer ({name})")
        self.name = name  # the tokens are recorded under the name of the engine that produced them
        return channel

    async def abort(self, request_id: str) -> None:
        channel = self._busy.get(request_id)
        if channel is not None:
            channel.close()

    async def _pause_generation(self) -> None:
        for channel in list(self._busy.values()):
            channel.close()

    async def _resume_generation(self) -> None:
        return None

    async def _load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        raise EngineStateError(f"engine '{self.name}' generates on rank {self.rank}, which loads its own weights")

    def shutdown(self) -> None:
        self.gone = self.gone or "this rank is closing"
        for channel in [*self._idle, *self._busy.values()]:
            channel.close()
        self._idle.clear()

    def _went(self, why: str) -> None:
        first = self.gone is None
        if first:
            log.info("rank %d's engine takes no more generations of this rank (%s): they go back to its own", self.rank,
                     why)
        self.gone = why
        self._pauses += 1  # what it cut continues on the rank's own engine
        if first and self._on_gone is not None:
            self._on_gone()


class RemoteEngines:
    """The other ranks' engines one rank routes generations to: one `RemoteEngine` per rank, a new one once the
    last answered no more (its rank was taken back from rollout and is lent again). `on_gone(rank)` is called,
    on the loop, when one goes: what was routed there generates at home from then on."""

    def __init__(self, register: Path, *, max_model_len: int, on_gone: Callable[[int], None]) -> None:
        self.register, self.max_model_len, self.on_gone = register, max_model_len, on_gone
        self._engines: dict[int, RemoteEngine] = {}

    def of(self, rank: int) -> RemoteEngine:
        engine = self._engines.get(rank)
        if engine is None or engine.gone is not None:
            engine = self._engines[rank] = RemoteEngine(self.register, rank, max_model_len=self.max_model_len,
                                                        on_gone=lambda: self.on_gone(rank))
        return engine

    def shutdown(self) -> None:
        for engine in self._engines.values():
            engine.shutdown()


class _Channel:
    """One connection to a door, its messages read by a thread of its own into the loop's queue (a thread per
    channel rather than the loop's executor, whose few threads the manager's calls need)."""

    def __init__(self, connection: Connection, loop: asyncio.AbstractEventLoop) -> None:
        self._connection, self._loop = connection, loop
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._closed = False
        threading.Thread(target=self._read, name="sfhpc-remote-engine", daemon=True).start()

    @classmethod
    async def open(cls, register: Path, rank: int) -> _Channel:
        """Knock on rank `rank`'s door, from a daemon thread of its own and within `KNOCK_TIMEOUT_S`: a door whose
        process is ending may take the connection and never answer the handshake, and a thread of the loop's
        executor stuck there would hold the interpreter's exit."""
        loop = asyncio.get_running_loop()
        knocked: asyncio.Future[Connection] = loop.create_future()

        def settle(connection: Connection | None, error: BaseException | None) -> None:
            if knocked.done():  # given up on meanwhile
                if connection is not None:
                    connection.close()
            elif error is not None:
                knocked.set_exception(error)
            else:
                knocked.set_result(connection)  # type: ignore[arg-type]

        def knock_now() -> None:
            try:
                connection = knock(register, door_name(rank), timeout_s=KNOCK_TIMEOUT_S,
                                   what=f"engine door of rank {rank}")
            except BaseException as exc:  # noqa: BLE001 (handed to the waiting coroutine)
                loop.call_soon_threadsafe(settle, None, exc)
            else:
                loop.call_soon_threadsafe(settle, connection, None)

        threading.Thread(target=knock_now, name="sfhpc-engine-knock", daemon=True).start()
        try:
            connection = await asyncio.wait_for(asyncio.shield(knocked), KNOCK_TIMEOUT_S)
        except TimeoutError:
            knocked.cancel()
            raise SfhpcError(f"the engine door of rank {rank} did not answer within {KNOCK_TIMEOUT_S:g} s") from None
        return cls(connection, loop)

    def _read(self) -> None:
        while True:
            try:
                message = self._connection.recv()
            except (EOFError, OSError) as exc:
                message = ("gone", "the connection closed" if self._closed else f"the connection broke ({exc})")
                self._loop.call_soon_threadsafe(self._queue.put_nowait, message)
                return
            self._loop.call_soon_threadsafe(self._queue.put_nowait, message)

    def send(self, message: Any) -> None:
        self._connection.send(message)

    async def next(self) -> tuple[str, Any]:
        """The next message: ``("chunk", GenerationChunk)``, ``("end", paused)`` or ``("gone", why)``; a
        connection closed here (an abort, a pause) reads as an end, not as the door going."""
        kind, body = await self._queue.get()
        if kind == "gone" and self._closed:
            return "end", False
        return kind, body

    def close(self) -> None:
        """End the connection: its reader wakes (a socket closed under a thread blocked reading it would not wake
        it, nor tell the door), and the door cancels a generation still running."""
        self._closed = True
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(self._connection.fileno())) as same:
            same.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._connection.close()
