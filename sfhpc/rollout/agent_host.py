"""Agent hosts: the nodes of an ``agents`` role, where the recipe's agent programs run, so that environments
that need CPUs of their own (code execution, compilers, test suites, simulators) do not compete with the
engines, and a site's CPU partition can hold them.

``python -m sfhpc.rank.agent_host RECIPE [--run-dir DIR]`` is one agent host. It is no rank of the MPI
world: the batch script starts the agents role's tasks with a step of their own (`sfhpc.launch.sbatch`), and
``sfhpc run`` starts them beside mpiexec, so losing one ends neither the world nor the job. Each host

- serves one route, ``POST /episodes``, guarded by a token of its own, and publishes its URL and token in
  the run folder (``agent-hosts/NAME.json``, mode 0600, rewritten when a requeued job starts it again);
- plays each episode it is handed with `LocalPrograms`: a working folder of its own, ``agent.memory_mb``,
  ``agent.container``, at most ``agent.workers`` programs at once, and ``agent.timeout_s`` counted from the
  program's start (not from the wait for a worker);
- answers with JSON lines: ``{"beat": ...}`` every `BEAT_S` while the episode waits or plays, ``{"started":
  true}`` when its program starts, and last ``{"end": LINE}`` (the program's end line, or null) or
  ``{"failure": REASON, "timed_out": SECONDS or null}``. A rank that goes away (its connection closes) ends
  the episode's program within a beat.

The programs call back to the rollout rank that handed the episode out (its ``base_url``, with that rank's
token): the controller's scheduler chose that rank by load, and the rank (`AgentHostsClient`) chooses the
host with the fewest of its episodes per worker. A host that cannot be reached is skipped for `DOWN_S`; one
lost while it plays (killed, its node gone, silent for `SILENT_S`) fails only the episodes it held, and the
others go to the hosts still up.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import random
import signal
import socket
import time
from pathlib import Path
from typing import Any

from aiohttp import ClientConnectionError, ClientError, ClientSession, ClientTimeout, web

from sfhpc.config.recipe import AgentSpec
from sfhpc.endpoint.auth import authorized, new_run_token
from sfhpc.endpoint.server import serve_app
from sfhpc.rollout.agent_process import AgentProgramFailed, EpisodeTimedOut, LocalPrograms
from sfhpc.rollout.supervise import describe_failure
from sfhpc.rundir import write_register

log = logging.getLogger("sfhpc")

BEAT_S = 2.0        # a host says it is alive this often while an episode waits or plays
SILENT_S = 30.0     # a host that says nothing this long is lost
DOWN_S = 10.0       # a host that could not be reached is skipped this long
HOST_WAIT_S = 120.0  # an episode waits this long for any host to be up (the hosts' step starts beside the ranks)
REREAD_S = 2.0      # the register is read again at most this often


# -- the host ---------------------------------------------------------------------------------------------

class AgentHost:
    """The episodes route of one agent host."""

    def __init__(self, spec: AgentSpec, recipe_source: str, *, timeout_s: float, token: str) -> None:
        self.runner = LocalPrograms(spec, recipe_source, node_role="an agent host")
        self.timeout_s, self.token = timeout_s, token
        self.played = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/episodes", self.episode)
        return app

    async def episode(self, request: web.Request) -> web.StreamResponse:
        if not authorized(request.headers.get("Authorization"), self.token):
            return web.json_response({"error": "this agent host takes episodes from its run's ranks only"},
                                     status=401)
        try:
            episode = await request.json()
        except ValueError:
            episode = None
        if not isinstance(episode, dict) or not {"episode_id", "base_url", "api_key", "model"} <= episode.keys():
            return web.json_response({"error": "the body must be an episode's input (episode_id, base_url, ...)"},
                                     status=400)
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        said: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        play = asyncio.ensure_future(self._play(episode, said))
        try:
            while True:
                done, _ = await asyncio.wait({play}, timeout=BEAT_S)
                while not said.empty():
                    await _say(response, said.get_nowait())
                if done:
                    await _say(response, play.result())
                    break
                await _say(response, {"beat": time.time()})
        except (ConnectionError, RuntimeError):  # the rank went away: its episode's program ends with it
            log.warning("episode %s: the rank that handed it out went away; its program is ended",
                        episode["episode_id"])
        finally:
            if not play.done():
                play.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await play
        return response

    async def _play(self, episode: dict[str, Any], said: asyncio.Queue[dict[str, Any]]) -> dict[str, Any]:
        async with self.runner.slot():
            said.put_nowait({"started": True})
            deadline = asyncio.timeout(self.timeout_s)
            try:
                async with deadline:
                    end = await self.runner.run(episode)
            except TimeoutError:
                if not deadline.expired():
                    raise
                return {"failure": f"timed out after {self.timeout_s:g} s", "timed_out": self.timeout_s}
            except AgentProgramFailed as exc:
                return {"failure": str(exc), "timed_out": None}
            except Exception as exc:  # noqa: BLE001 - one episode's fault is that episode's, never the host's
                log.warning("episode %s failed on this host", episode["episode_id"], exc_info=exc)
                return {"failure": describe_failure(exc), "timed_out": None}
            finally:
                self.played += 1
            return {"end": end}


async def _say(response: web.StreamResponse, line: dict[str, Any]) -> None:
    await response.write(json.dumps(line, default=str).encode() + b"\n")


async def serve_host(spec: AgentSpec, recipe_source: str, register: Path, name: str, *, bind: str,
                     timeout_s: float, stop: asyncio.Event) -> None:
    """Serve episodes until `stop` is set; the record in `register` says where."""
    token = new_run_token()
    host = AgentHost(spec, recipe_source, timeout_s=timeout_s, token=token)
    runner, port = await serve_app(host.app(), host=bind, shutdown_timeout=2.0)  # with the endpoint's connection limits
    advertised = socket.gethostname() if bind == "0.0.0.0" else bind
    url = f"http://{advertised}:{port}"
    record = write_register(register, name, {"name": name, "url": url, "token": token, "workers": spec.workers,
                                      "node": socket.gethostname(), "pid": os.getpid()})
    print(f"sfhpc agent host {name}: {spec.workers} worker(s) at {url} (registered in {record})", flush=True)
    try:
        await stop.wait()
    finally:
        await host.runner.close()
        await runner.cleanup()
        print(f"sfhpc agent host {name}: stopped after {host.played} episode(s)", flush=True)


async def run_host(spec: AgentSpec, recipe_source: str, register: Path, name: str, *, bind: str,
                   timeout_s: float) -> int:
    """Serve until the job ends it (TERM), a requeue or preemption signals it, or Ctrl-C."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        loop.add_signal_handler(signum, stop.set)  # its programs end with it
    await serve_host(spec, recipe_source, register, name, bind=bind, timeout_s=timeout_s, stop=stop)
    return 0


def host_name(index: int | None) -> str:
    """The host's name in the register: node and task (``n4-0``), unique in the job."""
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    task = index if index is not None else int(os.environ.get("SLURM_PROCID", "0"))
    return f"{node}-{task}"


# -- the rollout rank's side ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class HostRecord:
    name: str
    url: str
    token: str
    workers: int


class _NotReached(Exception):
    """The host could not be reached: the episode did not start there."""


class AgentHostsClient:
    """A rollout rank's `ProgramRunner` for a recipe with an agents role: each episode goes to an agent host
    from the register in `folder` (see the module)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.in_flight: dict[str, int] = {}
        self.down: dict[str, float] = {}   # url -> when it could not be reached
        self._hosts: list[HostRecord] = []
        self._read_at = -REREAD_S
        self._session: ClientSession | None = None

    def slot(self) -> contextlib.AbstractAsyncContextManager[Any]:
        return contextlib.nullcontext()  # the hosts bound their own programs

    @property
    def timed_here(self) -> bool:
        return False  # a host times its programs from their start

    def hosts(self) -> list[HostRecord]:
        """The hosts in the register, read again at most every `REREAD_S`."""
        now = time.monotonic()
        if now - self._read_at >= REREAD_S:
            self._read_at, found = now, []
            for path in sorted(self.folder.glob("*.json")):
                try:
                    raw = json.loads(path.read_text())
                    found.append(HostRecord(str(raw["name"]), str(raw["url"]), str(raw["token"]),
                                            max(1, int(raw["workers"]))))
                except (OSError, ValueError, KeyError, TypeError):
                    continue  # a record being replaced, or not one of ours
            self._hosts = found
        return self._hosts

    async def _choose(self) -> HostRecord:
        waited = time.monotonic()
        while True:
            now = time.monotonic()
            hosts = self.hosts()
            up = [h for h in hosts if now - self.down.get(h.url, -DOWN_S) >= DOWN_S]
            if up:
                return min(up, key=lambda h: (self.in_flight.get(h.url, 0) / h.workers, random.random()))
            if now - waited >= HOST_WAIT_S:
                what = (f"none of the {len(hosts)} in {self.folder} can be reached" if hosts
                        else f"none has registered in {self.folder}")
                raise AgentProgramFailed(f"no agent host is up after {HOST_WAIT_S:g} s: {what}")
            await asyncio.sleep(0.5)

    async def run(self, episode: dict[str, Any]) -> dict[str, Any] | None:
        while True:
            host = await self._choose()
            self.in_flight[host.url] = self.in_flight.get(host.url, 0) + 1
            try:
                return await self._play_on(host, episode)
            except _NotReached as exc:
                log.warning("agent host %s (%s) cannot be reached (%s); skipped for %g s", host.name, host.url,
                            exc, DOWN_S)
                self.down[host.url] = time.monotonic()
            finally:
                self.in_flight[host.url] -= 1

    async def _play_on(self, host: HostRecord, episode: dict[str, Any]) -> dict[str, Any] | None:
        if self._session is None:  # made on the loop that uses it
            # trust_env=False (aiohttp's default, said here): a site proxy never sees a host's token or episodes.
            self._session = ClientSession(timeout=ClientTimeout(total=None, sock_connect=10, sock_read=SILENT_S),
                                          trust_env=False)
        try:
            response = await self._session.post(f"{host.url}/episodes", json=episode,
                                                 headers={"Authorization": f"Bearer {host.token}"})
        except (ClientConnectionError, TimeoutError) as exc:
            raise _NotReached(describe_failure(exc)) from exc
        async with response:
            if response.status != 200:
                raise AgentProgramFailed(f"agent host {host.name} refused the episode: HTTP {response.status} "
                                         f"{(await response.text())[:200]}")
            last: dict[str, Any] | None = None
            try:
                async for line in response.content:
                    said = json.loads(line)
                    if "end" in said or "failure" in said:
                        last = said
                        break
            except (ClientError, TimeoutError, ValueError) as exc:
                self.down[host.url] = time.monotonic()
                why = (f"silent for {SILENT_S:g} s" if isinstance(exc, TimeoutError) else
                       "its connection broke" if isinstance(exc, ClientError) else describe_failure(exc))
                raise AgentProgramFailed(f"agent host {host.name} was lost during the episode ({why})") from exc
        if last is None:
            self.down[host.url] = time.monotonic()
            raise AgentProgramFailed(f"agent host {host.name} was lost during the episode (its connection closed)")
        if last.get("failure") is not None:
            if last.get("timed_out"):
                raise EpisodeTimedOut(float(last["timed_out"]))
            raise AgentProgramFailed(str(last["failure"]))
        end = last.get("end")
        return end if isinstance(end, dict) else None

    async def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

