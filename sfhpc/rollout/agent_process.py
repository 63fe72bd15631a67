"""Agent programs: the user's own executable plays an episode, knowing nothing of sfhpc but the OpenAI API.

Per episode the rollout rank opens an episode URL on its endpoint (`sfhpc.endpoint.episodes`) and starts
the recipe's ``agent.command``, contained (`sfhpc.rollout.containment`), with a minimal environment
(`program_environment`: no secret of the rank's unless ``agent.env`` names it) and

- ``OPENAI_BASE_URL`` = ``http://HOST:PORT/episodes/<id>/v1`` and ``OPENAI_API_KEY`` = the episode's key
  (it opens that episode's URLs alone), which every OpenAI client reads by itself: every call it makes is
  a turn of the episode's trajectory;
  ``OPENAI_MODEL`` = the served model's name (any name is accepted, so a program may keep its own);
- the switches that keep agent frameworks from reaching outside the run: the OpenAI Agents SDK's trace
  export (``OPENAI_AGENTS_DISABLE_TRACING``) and LangSmith's tracing (``LANGCHAIN_TRACING_V2``,
  ``LANGSMITH_TRACING``) are off;
- the episode's input, one JSON object, on stdin (and without the problem's data in ``SFHPC_EPISODE``):
  ``episode_id``, ``task``, ``model`` (the name to send), ``messages`` (the task's opening messages),
  ``problem`` (``key``, and ``data``, the task instance with its answer, only with
  ``agent.answer_to_program``), ``max_tokens`` (the reply budget) and ``seed`` (the episode's own, drawn from
  the run's seed: a program that draws at random may seed from it).

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
asks again, as an agent with its own tools or environment would. Its reward comes from
``agent.reward_source``: ``stdout`` (default) the last line of its stdout that is a JSON object with a
numeric ``"reward"``; ``post`` the last reward it posted to ``.../episodes/<id>/reward`` (refused, 403,
under the other sources); either way else, and under ``verifier`` always, the task's verifier on its final
reply (the latest reply of the episode, judged as the answer to the task's problem: `Episode.step` of a
fresh episode; not done counts 0).

Each episode runs in a private (0700) working folder of its own (``agent.workdir``, default the node's
``$TMPDIR``), made before the program starts and removed after the episode: the program's working folder
and ``TMPDIR``, or, for a serving program (which has a private folder of its own), ``workdir`` in the
episode's input. Every process of the program is bound by `ProgramLimits` (address space, file size, CPU
time, processes); ``agent.container`` is a command prefix (``[apptainer, exec, image.sif]``).

An exit status other than 0, a death by signal, or a program that made no call at all fails the episode
with the reason (the last line of stderr, and the endpoint's last refusal of the episode's calls, if any);
at the timeout the program is ended with every process it started (a serving program too: the slot starts
a new one for its next episode). Either way the run goes on (`sfhpc.rollout.supervise`).

Where the programs run is a `ProgramRunner`'s business: `LocalPrograms` starts them on this node (a rollout
rank, or an agent host), `sfhpc.rollout.agent_host.AgentHostsClient` hands them to the agent hosts of an
``agents`` role.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from sfhpc.config.recipe import AgentSpec
from sfhpc.endpoint.episodes import Episodes
from sfhpc.errors import SfhpcError
from sfhpc.rollout.agent import EpisodeOutcome
from sfhpc.rollout.containment import (
    NO_LIMITS,
    STOP_GRACE_S,
    ContainedProgram,
    Containment,
    ProgramLimits,
    program_environment,
)
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
                  base_url: str = "", api_key: str = "", with_data: bool = False,
                  seed: int | None = None) -> dict[str, Any]:
    """The JSON object an agent program reads on stdin (``SFHPC_EPISODE`` holds it without the problem's
    data); the runner adds the episode's ``workdir``. The problem's data, which holds its answer, only
    `with_data` (``agent.answer_to_program``: a program that plays the environment). `seed`: the episode's
    own, drawn from the run's (a program that draws at random may seed from it, so that two runs of one
    recipe play the same episodes)."""
    data = {"data": task.problem_to_json(problem.data)} if with_data else {}
    seeded = {"seed": seed} if seed is not None else {}
    return {"episode_id": episode_id, "task": task.name, "model": model,
            "messages": task.episode(problem).opening(), **seeded,
            "problem": {"key": problem.key, **data},
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


READERS_S = 5.0  # after the program ended, how long its output may still drain


async def run_program(command: Sequence[str], *, env: Mapping[str, str], stdin: str, cwd: str | None,
                      containment: Containment | None = None, limits: ProgramLimits = NO_LIMITS) -> ProgramRun:
    """Run `command` to its end, contained (`sfhpc.rollout.containment`): when it exits, or when this is
    cancelled (a timeout, the rank closing), every process it started is ended with it."""
    run = ProgramRun()
    program = await ContainedProgram.start(command, containment=containment or Containment.choose(), limits=limits,
                                           env=env, cwd=cwd, line_limit=LINE_LIMIT)
    process = program.process

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
        run.returncode = await program.exited()
    finally:
        if run.returncode is None:  # cancelled: end it all before giving up the slot
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(program.end())
        # Every process of it has ended, so its pipes are closed; a bound all the same.
        done, pending = await asyncio.wait(readers, timeout=READERS_S)
        for reader in pending:
            reader.cancel()
        for reader in done:
            if not reader.cancelled():
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
    with its ``{"episode_id": ..., ...}`` line on stdout (see the module). One episode at a time; it works
    in a private folder of its own, removed when it ends."""

    def __init__(self, program: ContainedProgram, folder: Path) -> None:
        self.program, self.process, self.folder = program, program.process, folder
        self.stderr: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self._ends: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._readers = [asyncio.ensure_future(self._read_stdout()), asyncio.ensure_future(self._read_stderr())]

    @classmethod
    async def start(cls, command: Sequence[str], *, env: Mapping[str, str], folder: Path,
                    containment: Containment, limits: ProgramLimits) -> ServingProgram:
        program = await ContainedProgram.start(command, containment=containment, limits=limits,
                                               env={**env, "TMPDIR": str(folder)}, cwd=str(folder),
                                               line_limit=LINE_LIMIT)
        return cls(program, folder)

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    async def play(self, episode_id: str, payload: str) -> dict[str, Any]:
        """Send one episode and wait for its end line; raises `AgentProgramFailed` if the program ends first."""
        ended = self._ends[episode_id] = asyncio.get_running_loop().create_future()
        exited = asyncio.ensure_future(self.program.exited())
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
        """End the program and all it started (a timeout, a cancelled episode, the rank closing)."""
        self.program.stop()
        for reader in self._readers:
            reader.cancel()

    async def ended(self, timeout_s: float) -> None:
        """Wait (bounded) until a killed program has ended, then remove its folder."""
        await self.program.exited(timeout_s)
        shutil.rmtree(self.folder, ignore_errors=True)

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

    async def close(self) -> None:
        """End what runs between episodes and wait (bounded) until it has: nothing outlives the loop."""
        ...


def episode_folder_base(spec: AgentSpec) -> Path:
    """The folder under which episodes get their working folders on this node."""
    return Path(spec.workdir or os.environ.get("TMPDIR") or tempfile.gettempdir())


def program_limits(spec: AgentSpec) -> ProgramLimits:
    return ProgramLimits(memory_mb=spec.memory_mb, file_mb=spec.max_file_mb, cpu_s=spec.max_cpu_s,
                         processes=spec.max_processes)


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
        self.limits = program_limits(spec)
        self.containment = Containment.choose(spec.containment)
        self._slots: asyncio.Semaphore | None = None
        self._serving: list[ServingProgram] = []  # agent.serve: the programs between episodes
        self._retiring: set[asyncio.Task[None]] = set()  # ended serving programs, waited for in the background

    def slot(self) -> asyncio.Semaphore:
        if self._slots is None:  # made on the loop that uses it
            self._slots = asyncio.Semaphore(self.spec.workers)
        return self._slots

    @property
    def timed_here(self) -> bool:
        return True

    def environment(self, episode: Mapping[str, Any], folder: Path) -> dict[str, str]:
        """The program's environment: the minimal set and ``agent.env`` (`program_environment`), its episode's
        URL and key, and its input without the problem's data (any process it starts reads its environment)."""
        url = str(episode["base_url"])
        env = {**program_environment(self.spec.env), **OFFLINE, "OPENAI_BASE_URL": url,
               "OPENAI_API_KEY": str(episode["api_key"]), "OPENAI_MODEL": str(episode["model"]),
               "TMPDIR": str(folder)}
        if episode.get("episode_id") is not None:
            public = json.dumps({**episode, "problem": {"key": (episode.get("problem") or {}).get("key")},
                                 "workdir": str(folder)}, default=str)
            if len(public) <= ENV_INPUT_LIMIT:
                env[EPISODE_VAR] = public
        # The calls go to the endpoint directly, never through a proxy the program might be told of.
        host = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)[0].strip("[]")
        for var in ("NO_PROXY", "no_proxy"):
            env[var] = ",".join(p for p in (env.get(var, ""), host) if p)
        return env

    async def run(self, episode: dict[str, Any]) -> dict[str, Any] | None:
        self.base.mkdir(parents=True, exist_ok=True)
        folder = _private_folder(self.base, f"sfhpc-episode-{episode['episode_id']}-")
        try:
            payload = json.dumps({**episode, "workdir": str(folder)}, default=str)
            if self.spec.serve:
                return await self._serve(episode, payload)
            run = await run_program(self.command, env=self.environment(episode, folder), stdin=payload + "\n",
                                    cwd=str(folder), containment=self.containment, limits=self.limits)
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
        episode did not end cleanly (cancelled, timed out, failed) is ended, never given another."""
        while self._serving and not self._serving[-1].alive:
            self._retire(self._serving.pop())
        if self._serving:
            program = self._serving.pop()
        else:  # its own URL names no episode: calls must go to each episode's base_url
            nowhere = {"base_url": str(episode["base_url"]).rsplit("/episodes/", 1)[0] + "/episodes/none/v1",
                       "api_key": "none", "model": episode["model"]}
            folder = _private_folder(self.base, "sfhpc-serving-")
            program = await ServingProgram.start(self.command, env=self.environment(nowhere, folder), folder=folder,
                                                 containment=self.containment, limits=self.limits)
        try:
            end = await program.play(str(episode["episode_id"]), payload)
        except BaseException:
            self._retire(program)
            raise
        self._serving.append(program)
        return end

    def _retire(self, program: ServingProgram) -> None:
        program.kill()
        task = asyncio.get_running_loop().create_task(program.ended(STOP_GRACE_S + 1))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def close(self) -> None:
        """End the serving programs and wait until they, and those retired before, have exited: a process
        that outlived this loop would leave asyncio's child watcher complaining on the console."""
        closing = []
        while self._serving:
            program = self._serving.pop()
            program.kill()
            closing.append(program.ended(STOP_GRACE_S + 1))
        ends = [*closing, *self._retiring]
        if ends:
            await asyncio.gather(*ends, return_exceptions=True)


def _private_folder(base: Path, prefix: str) -> Path:
    """A new folder only its owner may enter (``mkdtemp`` makes it 0700), so no other user of a shared
    ``$TMPDIR`` can plant a module or read what the program writes."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))

class AgentPrograms:
    """Plays episodes with the recipe's agent program through `runner` (default: on this node, at most
    ``workers`` at once, one rank's share).

    `url_of` gives an episode's base URL (the endpoint server's `episode_url`); each episode's program gets
    that episode's own key. Methods run on the endpoint's event loop, where `episodes` are served.
    """

    def __init__(self, spec: AgentSpec, *, recipe_source: str, episodes: Episodes, url_of: Callable[[str], str],
                 model: str, runner: ProgramRunner | None = None) -> None:
        self.spec, self.episodes, self.url_of, self.model = spec, episodes, url_of, model
        self.runner: ProgramRunner = runner if runner is not None else LocalPrograms(spec, recipe_source)

    @property
    def slots(self) -> contextlib.AbstractAsyncContextManager[Any]:
        return self.runner.slot()

    async def play(self, task: Task, problem: Problem, *, group: str, max_tokens: int,
                   on_trajectory: Callable[[str], None], seed: int | None = None) -> EpisodeOutcome:
        """One episode: run the program against its episode URL, then take its reward (see the module)."""
        source = self.spec.reward_source
        episode = self.episodes.open(task=task.name, group=group, on_trajectory=on_trajectory,
                                     takes_posted_reward=source == "post")
        try:
            end = await self.runner.run(episode_input(
                episode.id, task, problem, model=self.model, max_tokens=max_tokens, base_url=self.url_of(episode.id),
                api_key=episode.key, with_data=self.spec.answer_to_program, seed=seed))
        except AgentProgramFailed as exc:
            if episode.refusal is None:
                raise
            raise AgentProgramFailed(f"{exc}; the endpoint refused its last call: {episode.refusal}") from None
        finally:
            self.episodes.close(episode.id)
        answered = [(seat, tid) for seat in episode.seats.values() for tid in seat.trajectories
                    if tid in seat.replies]  # a reply may be empty text (only the end-of-turn token)
        if not answered:
            why = (f"; the endpoint refused its last call: {episode.refusal}" if episode.refusal else
                   ": it must call the OpenAI API at the episode's base_url ($OPENAI_BASE_URL)")
            raise AgentProgramFailed("the agent program ended its episode without a reply from the endpoint" + why)
        printed = source == "stdout"  # the end line's rewards count under stdout alone
        per_agent, shared = (_agent_rewards(end), _reward_of(end)) if printed else ({}, None)
        posted = episode.seats[""].reward if "" in episode.seats else None
        rewards = []
        for seat, tid in answered:  # an agent's trajectories: one, or one per choice of a call with n > 1
            # Printed (stdout: for this agent, then for all), or posted (post: for this agent, then for all),
            # else the task's verifier on this trajectory's last reply.
            reward = next((r for r in (per_agent.get(seat.agent), shared, seat.reward, posted) if r is not None),
                          None)
            if reward is None:
                result = task.episode(problem).step(seat.replies[tid])
                reward = result.reward if result.done else 0.0
            rewards.append((tid, reward))
        (first, reward), others = rewards[0], tuple(rewards[1:])
        per_reply = turn_rewards_of(end) if printed and not others else ()  # one trajectory: its replies in order
        return EpisodeOutcome(first, reward, sum(seat.calls for seat in episode.seats.values()), per_reply, others)

    async def close(self) -> None:
        await self.runner.close()
