"""Agent programs: the user's own executable plays an episode, knowing nothing of sfhpc but the OpenAI API.

Per episode the rollout rank opens an episode URL on its endpoint (`sfhpc.endpoint.episodes`) and starts
the recipe's ``agent.command`` in a process group of its own, with

- ``OPENAI_BASE_URL`` = ``http://HOST:PORT/episodes/<id>/v1`` and ``OPENAI_API_KEY`` = the run's token, which
  every OpenAI client reads by itself: every call it makes is a turn of the episode's trajectory;
  ``OPENAI_MODEL`` = the served model's name (any name is accepted, so a program may keep its own);
- the switches that keep agent frameworks from reaching outside the run: the OpenAI Agents SDK's trace
  export (``OPENAI_AGENTS_DISABLE_TRACING``) and LangSmith's tracing (``LANGCHAIN_TRACING_V2``,
  ``LANGSMITH_TRACING``) are off;
- the episode's input, one JSON object, on stdin and in ``SFHPC_EPISODE``: ``episode_id``, ``task``,
  ``model`` (the name to send), ``messages`` (the task's opening messages), ``problem`` (``key`` and
  ``data``: the task instance) and ``max_tokens`` (the reply budget).

The input also names ``base_url`` and ``api_key``, so that one program can play several episodes: with
``agent.serve`` each of the rank's ``agent.workers`` slots keeps one program running, which reads one
episode's JSON per line on stdin and ends each episode with a stdout line ``{"episode_id": <its id>,
"reward": x}`` (or ``"done": true`` to leave the reward to the steps below), then reads the next. Its
``OPENAI_BASE_URL`` then names no episode (calls to it get a 404): each episode's calls go to its own
``base_url``. A program written as a loop over stdin lines that prints that line serves both ways.

Several agents may play one episode (a solver and a checker, the players of a game): agent NAME's base URL
is ``{agents_base_url}/NAME/v1`` (``agents_base_url`` is in the input), each agent's calls are a trajectory of
its own in the episode's group, and the end line may reward each: ``{"episode_id": ..., "rewards":
{"solver": 1.0, "checker": 0.0}}`` (a plain ``"reward"`` goes to every agent). GRPO compares each agent's
trajectories with the same agent's in the group's other episodes (`Trajectory.advantage_group`).
An episode of one trajectory may also reward each reply: ``"turn_rewards": [1, 0, 1]`` in the end line, one
number per call in order (what ``credit: turn`` with ``turn_reward_weight`` trains on; `sfhpc.trainer.losses`).

The program drives the conversation: for a multi-turn task it sends a follow-up message after a reply and
asks again, as an agent with its own tools or environment would. Its reward is, in this order: the last
line of its stdout that is a JSON object with a numeric ``"reward"``, else the last reward it posted to
``.../episodes/<id>/reward``, else the task's verifier on its final reply (the latest reply of the episode,
judged as the answer to the task's problem: `Episode.step` of a fresh episode; not done counts 0).

Each episode runs in a working folder of its own (``agent.workdir``, default the node's ``$TMPDIR``), made
before the program starts and removed after the episode: the program's working folder, or, for a serving
program, ``workdir`` in the episode's input. Every process of the program may take at most
``agent.memory_mb`` of address space (``RLIMIT_AS``: no cgroups needed) and dies with the process that
started it; ``agent.container`` is a command prefix (``[apptainer, exec, image.sif]``).

An exit status other than 0, a death by signal, or a program that made no call at all fails the episode
with the reason (and the last line of stderr); at the timeout the whole process group is killed (a serving
program too: the slot starts a new one for its next episode). Either way the run goes on
(`sfhpc.rollout.supervise`).

Where the programs run is a `ProgramRunner`'s business: `LocalPrograms` starts them on this node (a rollout
rank, or an agent host), `sfhpc.rollout.agent_host.AgentHostsClient` hands them to the agent hosts of an
``agents`` role.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import json
import logging
import math
import os
import resource
import shutil
import signal
import socket
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from sfhpc.config.recipe import AgentSpec
from sfhpc.endpoint.episodes import Episodes
from sfhpc.errors import SfhpcError
from sfhpc.rollout.agent import EpisodeOutcome
from sfhpc.tasks.base import Problem, Task

log = logging.getLogger("sfhpc")

EPISODE_VAR = "SFHPC_EPISODE"
ENV_INPUT_LIMIT = 96 * 1024  # Linux refuses one environment string over 128 KiB: larger inputs go on stdin only
STDERR_LINES = 20            # kept for the failure reason and the rank's log
LINE_LIMIT = 1 << 20         # longer stdout lines are not read as a reward


# Frameworks that would send traces to a vendor's servers: an agent in a run talks to the run alone.
OFFLINE = {"OPENAI_AGENTS_DISABLE_TRACING": "1", "LANGCHAIN_TRACING_V2": "false", "LANGSMITH_TRACING": "false"}


class AgentProgramFailed(Exception):
    """The agent program ended its episode without an answer (the message is the reason recorded)."""


class EpisodeTimedOut(AgentProgramFailed):
    """The program outlived its time limit (measured where it ran) and was killed."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"timed out after {seconds:g} s")
        self.seconds = seconds


def episode_input(episode_id: str, task: Task, problem: Problem, *, model: str, max_tokens: int,
                  base_url: str = "", api_key: str = "") -> dict[str, Any]:
    """The JSON object an agent program reads on stdin (and in ``SFHPC_EPISODE``); the runner adds the
    episode's ``workdir``."""
    return {"episode_id": episode_id, "task": task.name, "model": model,
            "messages": task.episode(problem).opening(),
            "problem": {"key": problem.key, "data": task.problem_to_json(problem.data)},
            "max_tokens": max_tokens, "base_url": base_url, "api_key": api_key,
            "agents_base_url": base_url.removesuffix("/v1") + "/agents" if base_url else ""}


def _json_line(line: str) -> dict[str, Any] | None:
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def rewards_line(line: str) -> dict[str, Any] | None:
    """A stdout line that rewards the episode: a JSON object with a numeric ``reward`` or per-agent
    ``rewards``; None for any other line."""
    value = _json_line(line)
    return value if value is not None and (_reward_of(value) is not None or _agent_rewards(value)) else None


def reward_line(line: str) -> float | None:
    """The reward of a stdout line like ``{"reward": 1.0}``; None for any other line."""
    return _reward_of(rewards_line(line))


def _reward_of(value: Any) -> float | None:
    """The ``reward`` of a decoded line (None when it holds no finite number there)."""
    reward = value.get("reward") if isinstance(value, dict) else None
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        return None
    return float(reward)


def _agent_rewards(value: Any) -> dict[str, float]:
    """The per-agent ``rewards`` of a decoded line (``{"rewards": {"solver": 1, "checker": 0}}``)."""
    rewards = value.get("rewards") if isinstance(value, dict) else None
    if not isinstance(rewards, dict):
        return {}
    return {str(agent): r for agent, r in ((a, _reward_of({"reward": v})) for a, v in rewards.items())
            if r is not None}


def turn_rewards_of(value: Any) -> tuple[float, ...]:
    """The per-reply ``turn_rewards`` of a decoded line: a list of finite numbers; () for anything else."""
    found = value.get("turn_rewards") if isinstance(value, dict) else None
    if not isinstance(found, list) or not all(
            isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) for r in found):
        return ()
    return tuple(float(r) for r in found)


class ProgramRun:
    """What one run of the program left: its exit status, its last reward line, its last stderr lines."""

    def __init__(self) -> None:
        self.returncode: int | None = None
        self.end: dict[str, Any] | None = None  # the last stdout line that is a JSON object with rewards
        self.stderr: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)

    @property
    def reward(self) -> float | None:
        return _reward_of(self.end)

    def failure(self) -> str | None:
        """Why the exit is a failure (None for status 0)."""
        code = self.returncode
        if code == 0:
            return None
        if code is not None and code < 0:
            try:
                what = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                what = f"was killed by signal {-code}"
        else:
            what = f"exited with status {code}"
        last = next((line for line in reversed(self.stderr) if line.strip()), "")
        return f"the agent program {what}" + (f"; its stderr ends: {last.strip()}" if last else "")


class ProcessLimits:
    """What a program's process may take: address space (``RLIMIT_AS``, in MiB, None: no limit); and it dies
    with the process that started it (``PR_SET_PDEATHSIG``), so a killed rank or agent host leaves none
    behind. Applied in the child between fork and exec."""

    def __init__(self, memory_mb: int | None = None) -> None:
        self.memory_mb = memory_mb
        self._prctl = _libc_prctl()  # looked up before the fork: the child only calls it

    def __call__(self) -> None:
        if self.memory_mb is not None:
            limit = self.memory_mb << 20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        if self._prctl is not None:
            self._prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _libc_prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the program outlives a killed parent until its calls fail
        return None


async def _start(command: tuple[str, ...], *, env: Mapping[str, str], cwd: str | None,
                 limits: ProcessLimits | None) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=dict(env), cwd=cwd, start_new_session=True, limit=LINE_LIMIT, preexec_fn=limits)


async def run_program(command: tuple[str, ...], *, env: Mapping[str, str], stdin: str, cwd: str | None,
                      limits: ProcessLimits | None = None) -> ProgramRun:
    """Run `command` to its end in a new process group; cancelling (a timeout, the rank closing) kills the
    whole group. Whatever the program leaves behind in its group is killed when it exits."""
    run = ProgramRun()
    process = await _start(command, env=env, cwd=cwd, limits=limits)

    async def feed() -> None:
        assert process.stdin is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a program need not read its input
            process.stdin.write(stdin.encode())
            await process.stdin.drain()
            process.stdin.close()

    async def read_stdout() -> None:
        assert process.stdout is not None
        async for line in _lines(process.stdout):
            run.end = rewards_line(line) or run.end

    async def read_stderr() -> None:
        assert process.stderr is not None
        async for line in _lines(process.stderr):
            run.stderr.append(line.rstrip("\n"))

    readers = [asyncio.ensure_future(f()) for f in (feed, read_stdout, read_stderr)]
    try:
        run.returncode = await process.wait()
    finally:
        _kill_group(process.pid)
        if run.returncode is None:  # cancelled: reap the killed program before giving up the slot
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(process.wait())
        # The pipes close once the group is gone; a child that left the group may hold them: stop reading.
        done, pending = await asyncio.wait(readers, timeout=5)
        for reader in pending:
            reader.cancel()
        for reader in done:
            reader.exception()  # a reader's own error (a pipe gone) is no error of the episode
    return run


async def _lines(stream: asyncio.StreamReader) -> AsyncIterator[str]:
    """The stream's lines, decoded; a line longer than LINE_LIMIT is skipped (the reader drops it), so
    that the pipe keeps draining and the program never blocks on a full one."""
    skipping = False  # within a long line: the reader gave up a chunk of it, its rest is still to come
    while True:
        try:
            line = await stream.readline()
        except ValueError:
            skipping = True
            continue
        if not line:
            return
        if skipping:
            skipping = not line.endswith(b"\n")
            continue
        yield line.decode(errors="replace")


class ServingProgram:
    """One long-lived agent program (``agent.serve``): episodes go in as lines on its stdin, and each ends
    with its ``{"episode_id": ..., ...}`` line on stdout (see the module). One episode at a time."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.stderr: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self._ends: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._readers = [asyncio.ensure_future(self._read_stdout()), asyncio.ensure_future(self._read_stderr())]

    @classmethod
    async def start(cls, command: tuple[str, ...], *, env: Mapping[str, str], cwd: str | None,
                    limits: ProcessLimits | None = None) -> ServingProgram:
        return cls(await _start(command, env=env, cwd=cwd, limits=limits))

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    async def play(self, episode_id: str, payload: str) -> dict[str, Any]:
        """Send one episode and wait for its end line; raises `AgentProgramFailed` if the program ends first."""
        ended = self._ends[episode_id] = asyncio.get_running_loop().create_future()
        exited = asyncio.ensure_future(self.process.wait())
        try:
            assert self.process.stdin is not None
            self.process.stdin.write(payload.encode() + b"\n")
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it died: `exited` says how
                await self.process.stdin.drain()
            await asyncio.wait({ended, exited}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
            self._ends.pop(episode_id, None)
        if ended.done():
            return ended.result()
        run = ProgramRun()
        run.returncode, run.stderr = self.process.returncode, self.stderr
        raise AgentProgramFailed((run.failure() or "the agent program exited") + " before its episode's end line")

    def kill(self) -> None:
        """Kill the program's whole process group (a timeout, a cancelled episode, the rank closing)."""
        _kill_group(self.process.pid)
        for reader in self._readers:
            reader.cancel()

    async def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        async for line in _lines(self.process.stdout):
            value = _json_line(line)
            ended = self._ends.get(str(value.get("episode_id"))) if value is not None else None
            if value is not None and ended is not None and not ended.done():
                ended.set_result(value)

    async def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        async for line in _lines(self.process.stderr):
            self.stderr.append(line.rstrip("\n"))


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


class ProgramRunner(Protocol):
    """Runs the agent program for one episode and gives back its end line (None when it printed none);
    raises `AgentProgramFailed` with the reason when the episode failed."""

    def slot(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """Held while an episode waits for and plays its program: bounds the episodes at once here."""
        ...

    @property
    def timed_here(self) -> bool:
        """Whether the caller bounds an episode's time (False: where the program runs bounds it)."""
        ...

    async def run(self, episode: dict[str, Any]) -> dict[str, Any] | None: ...

    def close(self) -> None: ...


def episode_folder_base(spec: AgentSpec) -> Path:
    """The folder under which episodes get their working folders on this node."""
    return Path(spec.workdir or os.environ.get("TMPDIR") or tempfile.gettempdir())


class LocalPrograms:
    """Starts the program on this node: one per episode, or ``agent.serve`` programs kept between episodes;
    at most ``agent.workers`` at once. `node_role` names where it runs, for a program missing here."""

    def __init__(self, spec: AgentSpec, recipe_source: str, *, node_role: str = "a rollout rank") -> None:
        program = spec.program(recipe_source)
        if isinstance(program, str):  # checked when the recipe was read; this node may differ
            raise SfhpcError(f"{recipe_source}: agent.command: {program} on {socket.gethostname()}, where "
                             f"{node_role} runs; install it there (or on a shared file system)")
        if spec.container and shutil.which(spec.container[0]) is None:
            raise SfhpcError(f"{recipe_source}: agent.container: program '{spec.container[0]}' is not on PATH on "
                             f"{socket.gethostname()}, where {node_role} runs")
        self.spec = spec
        self.command = spec.argv(recipe_source)
        self.base = episode_folder_base(spec)
        self.limits = ProcessLimits(spec.memory_mb)
        self._slots: asyncio.Semaphore | None = None
        self._serving: list[ServingProgram] = []  # agent.serve: the programs between episodes
        self._closed: list[ServingProgram] = []

    def slot(self) -> asyncio.Semaphore:
        if self._slots is None:  # made on the loop that uses it
            self._slots = asyncio.Semaphore(self.spec.workers)
        return self._slots

    @property
    def timed_here(self) -> bool:
        return True

    def environment(self, episode: Mapping[str, Any], episode_json: str) -> dict[str, str]:
        url = str(episode["base_url"])
        env = {**os.environ, **OFFLINE, "OPENAI_BASE_URL": url, "OPENAI_API_KEY": str(episode["api_key"]),
               "OPENAI_MODEL": str(episode["model"])}
        if episode_json and len(episode_json) <= ENV_INPUT_LIMIT:
            env[EPISODE_VAR] = episode_json
        else:
            env.pop(EPISODE_VAR, None)
        # A cluster's HTTP proxy must not carry calls to the endpoint away from the cluster.
        host = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)[0].strip("[]")
        for var in ("NO_PROXY", "no_proxy"):
            env[var] = ",".join(p for p in (env.get(var, ""), host) if p)
        return env

    async def run(self, episode: dict[str, Any]) -> dict[str, Any] | None:
        self.base.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix=f"sfhpc-episode-{episode['episode_id']}-", dir=self.base))
        try:
            payload = json.dumps({**episode, "workdir": str(folder)}, default=str)
            if self.spec.serve:
                return await self._serve(episode, payload)
            run = await run_program(self.command, env=self.environment(episode, payload), stdin=payload + "\n",
                                    cwd=str(folder), limits=self.limits)
            failure = run.failure()
            if failure is not None:
                log.warning("agent program of episode %s: %s\n%s", episode["episode_id"], failure,
                            "\n".join(run.stderr))
                raise AgentProgramFailed(failure)
            return run.end
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    async def _serve(self, episode: Mapping[str, Any], payload: str) -> dict[str, Any]:
        """An episode on a serving program (a running one between episodes, else a new one); a program whose
        episode did not end cleanly (cancelled, timed out, failed) is killed, never given another."""
        while self._serving and not self._serving[-1].alive:
            self._serving.pop().kill()
        if self._serving:
            program = self._serving.pop()
        else:  # its own URL names no episode: calls must go to each episode's base_url
            nowhere = {**episode, "base_url": str(episode["base_url"]).rsplit("/episodes/", 1)[0] + "/episodes/none/v1"}
            program = await ServingProgram.start(self.command, env=self.environment(nowhere, ""), cwd=str(self.base),
                                                 limits=self.limits)
        try:
            end = await program.play(str(episode["episode_id"]), payload)
        except BaseException:
            program.kill()
            raise
        self._serving.append(program)
        return end

    def close(self) -> None:
        """Kill the serving programs (they would also end at the end of their stdin, when the rank exits)."""
        self._closed = list(self._serving)
        while self._serving:
            self._serving.pop().kill()

    async def wait_closed(self, timeout_s: float = 5.0) -> None:
        """Reap the programs `close` killed, so that their pipes close on this loop before it ends."""
        waits = [p.process.wait() for p in self._closed]
        if waits:
            await asyncio.wait_for(asyncio.gather(*waits, return_exceptions=True), timeout_s)


class AgentPrograms:
    """Plays episodes with the recipe's agent program through `runner` (default: on this node, at most
    ``workers`` at once, one rank's share).

    `url_of` gives an episode's base URL (the endpoint server's `episode_url`); `token` is the run's.
    Methods run on the endpoint's event loop, where `episodes` are served.
    """

    def __init__(self, spec: AgentSpec, *, recipe_source: str, episodes: Episodes, url_of: Callable[[str], str],
                 token: str | None, model: str, runner: ProgramRunner | None = None) -> None:
        self.episodes, self.url_of, self.token, self.model = episodes, url_of, token, model
        self.runner: ProgramRunner = runner if runner is not None else LocalPrograms(spec, recipe_source)

    @property
    def slots(self) -> contextlib.AbstractAsyncContextManager[Any]:
        return self.runner.slot()

    async def play(self, task: Task, problem: Problem, *, group: str, max_tokens: int,
                   on_trajectory: Callable[[str], None]) -> EpisodeOutcome:
        """One episode: run the program against its episode URL, then take its reward (see the module)."""
        episode = self.episodes.open(task=task.name, group=group, on_trajectory=on_trajectory)
        try:
            end = await self.runner.run(episode_input(
                episode.id, task, problem, model=self.model, max_tokens=max_tokens, base_url=self.url_of(episode.id),
                api_key=self.token or "none"))
        finally:
            self.episodes.close(episode.id)
        answered = [(seat, tid) for seat in episode.seats.values() for tid in seat.trajectories
                    if tid in seat.replies]  # a reply may be empty text (only the end-of-turn token)
        if not answered:
            raise AgentProgramFailed("the agent program ended its episode without a reply from the endpoint: it "
                                     "must call the OpenAI API at the episode's base_url ($OPENAI_BASE_URL)")
        per_agent, shared = _agent_rewards(end), _reward_of(end)
        posted = episode.seats[""].reward if "" in episode.seats else None
        rewards = []
        for seat, tid in answered:  # an agent's trajectories: one, or one per choice of a call with n > 1
            # Printed (for this agent, then for all), then posted (for this agent, then for all), then the
            # task's verifier on this trajectory's last reply.
            reward = next((r for r in (per_agent.get(seat.agent), shared, seat.reward, posted) if r is not None),
                          None)
            if reward is None:
                result = task.episode(problem).step(seat.replies[tid])
                reward = result.reward if result.done else 0.0
            rewards.append((tid, reward))
        (first, reward), others = rewards[0], tuple(rewards[1:])
        per_reply = turn_rewards_of(end) if not others else ()  # one trajectory: its replies in order
        return EpisodeOutcome(first, reward, sum(seat.calls for seat in episode.seats.values()), per_reply, others)

    def close(self) -> None:
        self.runner.close()
