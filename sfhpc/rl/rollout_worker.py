"""A rollout rank: a vLLM engine, the agent endpoint in front of it, and the agents that play episodes.

Threads. The endpoint's event loop runs in its own thread (engine, HTTP server, agents, and the calls
to the trajectory manager, which travel over the manager's communicator). The main thread owns the
control channel: it waits for the controller's commands and, for a weight update, pauses the engine,
receives the broadcast and loads it. An agent never notices a weight update: its call just takes longer.

A trainer rank lent to rollout (``seamless``) runs a `RolloutWorker` too, beside its trainer: when it is
taken back (`RolloutWorker.reclaim`) its generations are cut at a token boundary and recorded, and the
episodes it held go back to the controller, which continues them on other ranks from their prefix.

An agent program's episode cannot go back: the program and its connections stay on this rank. Its generation
moves instead (`sfhpc.engine.remote`): the endpoint routes the episode's turns to the engine of a rank the
controller names, where they continue from their prefix; its end counts for that rank (`COUNTS_FOR`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from sfhpc.config.recipe import Recipe
from sfhpc.data.service import ManagerClient
from sfhpc.endpoint import AgentEndpoint, EndpointServer, OpenAIApi, new_run_token
from sfhpc.endpoint.client import AsyncLocalClient
from sfhpc.endpoint.service import SamplingRule
from sfhpc.engine.base import EngineDied, RolloutEngine
from sfhpc.engine.remote import GenerationDoor, RemoteEngine, RemoteEngines
from sfhpc.engine.tokenizer import ChatTokenizer
from sfhpc.rl.messages import EpisodeTicket
from sfhpc.rollout.agent import (
    ChatBackend,
    EpisodeOutcome,
    LocalChat,
    OpenAIChat,
    ResumePoint,
    play_episode,
    reply_budget,
    resumed_turn_budget,
)
from sfhpc.rollout.agent_host import AgentHostsClient
from sfhpc.rollout.agent_process import AgentPrograms
from sfhpc.rollout.containment import STOP_GRACE_S
from sfhpc.rollout.supervise import play_or_fail
from sfhpc.rundir import RunPaths
from sfhpc.runtime import fault_injection, preemption
from sfhpc.runtime.comm_layout import CommLayout
from sfhpc.tasks.base import Task
from sfhpc.weights.group import WeightGroup

log = logging.getLogger("sfhpc")


class RolloutWorker:
    def __init__(self, recipe: Recipe, task: Task, layout: CommLayout, engine_factory: Any,
                 trainer: Any | None = None, tokenizer: ChatTokenizer | None = None, lendable: bool = False,
                 agent_hosts: Path | None = None, model_dir: Path | None = None, puller: Any | None = None,
                 engine_doors: Path | None = None) -> None:
        """`lendable`: a trainer rank lent to rollout now and then (``seamless``), which `reclaim` takes back, or a
        worker of another job (`sfhpc.rl.attached`), which leaves the same way; `agent_hosts`: the run folder's
        register of agent hosts, where a recipe with an agents role finds them; `model_dir`: the folder the engine
        started from, into which a LoRA run's adapter versions are merged; `puller`: a worker of another job pulls
        each version from the first trainer's weight server (`sfhpc.weights.version_server.VersionPuller`);
        `engine_doors`: where the ranks' engine doors are registered, with agent programs whose episodes may move
        (``seamless``): this rank serves their generations and routes its own (`sfhpc.engine.remote`)."""
        self.recipe, self.task, self.layout = recipe, task, layout
        self.rank = layout.world.Get_rank()
        self.manager = ManagerClient(layout.manager_link, layout.controller_rank)
        # A reclaim must name the trajectory of an episode cut in its first turn, which its agent has not
        # heard yet (the id comes with the first reply): the endpoint's starts are noted by group.
        self.starts = _StartsByGroup(self.manager) if lendable else None
        # The engine starts on the endpoint's loop: vLLM's AsyncLLM binds to the loop that first uses it.
        placeholder = _Idle()
        self.endpoint = AgentEndpoint(placeholder, self.starts or self.manager)
        # A token of the run's own, demanded on every route (loopback too): another user on a shared node
        # cannot add trajectories to this run. The run's HTTP agents send it.
        token = new_run_token()
        self.server = EndpointServer(OpenAIApi(self.endpoint, model_name=recipe.model.name, tokenizer=tokenizer,
                                               token=token,
                                               # A turn without a temperature gets the recipe's; what the
                                               # trainer cannot match is refused with a 400.
                                               sampling_rule=SamplingRule(
                                                   recipe.algorithm.temperature,
                                                   None if recipe.evaluation is None
                                                   else recipe.evaluation.temperature),
                                               tool_parser=recipe.model.tool_parser,
                                               max_n=recipe.budgets.max_choices),
                                     **_endpoint_address(recipe)).start()
        # The recipe's own agent program plays the episodes instead of the built-in agent, if it names one.
        self.programs = None if recipe.agent is None else AgentPrograms(
            recipe.agent, recipe_source=recipe.source, episodes=self.server.api.episodes,
            url_of=self.server.episode_url, model=recipe.model.name,
            # With an agents role the programs run on agent hosts, nodes of their own.
            runner=None if recipe.agent_hosts is None or agent_hosts is None else AgentHostsClient(agent_hosts))

        self.engine_factory = engine_factory
        self.engine_restarts = 0  # engines restarted after their processes died (`engine.max_restarts`)
        self.watching: asyncio.Task[None]  # the current engine's watch (`_watch`)
        self.fatal: BaseException | None = None  # what ends the run from the endpoint's loop (a dead engine)
        # One engine change at a time: a restart and a weight update never interleave (the update's buckets land
        # in the copy a restart loads from).
        self.engine_lock = asyncio.Lock()
        self.synced_to = 0  # the version this rank was last told to hold (what a restart's engine must hold)
        self.paused_at = 0.0  # when the last weight update paused the engine (wall clock: the run's timeline)
        self.engine: RolloutEngine = self.server.call(self._start_engine(), timeout=600)
        self.engine_doors = engine_doors
        self.door = None if self.engine_doors is None else GenerationDoor(
            self.engine_doors, self.rank, self.server.loop, self.endpoint.running_engine, lambda: self.engine.name)
        # Other ranks' engines, where moved episodes generate.
        self.remotes = None if self.engine_doors is None else RemoteEngines(
            self.engine_doors, max_model_len=self.engine.max_model_len, on_gone=self._came_home)
        # Agent programs' episodes playing here whose generations run on another rank: that rank, by episode task.
        self.routed_to: dict[asyncio.Task[Any], int] = {}
        self.backend: ChatBackend = (OpenAIChat(self.server.url, recipe.model.name, api_key=token)
                                     if task.max_turns > 1
                                     else LocalChat(AsyncLocalClient(self.server.api), recipe.model.name))
        self.trainer = trainer  # colocated: this rank also trains, and loads its own weights
        self.receiver = None
        self.puller = puller
        if trainer is None and layout.weight_broadcast is not None:
            from sfhpc.weights.publisher import WeightReceiver
            from sfhpc.weights.transport import connect

            def join_engine(group: WeightGroup, first_member: int) -> None:
                self.server.call(self.engine.join_weight_group(group, first_member), timeout=group.timeout_s + 60)

            # With delta updates, or engines that may restart, the rank receives each version itself and keeps a
            # copy (what a delta applies to, what a restarted engine loads), so an engine that could join the
            # weight group does not. Staged updates need a copy beside the engine's weights: the engine's own
            # where its processes receive, else the rank's.
            own_copy = recipe.engine.weight_delta or recipe.engine.max_restarts > 0
            members = 0 if own_copy else self.engine.weight_group_members
            transport = connect(layout.weight_broadcast, recipe.engine.weight_transport, engine_members=members,
                                join_engine=join_engine if members else None)
            if recipe.timing_model.weight_transfer_s:
                from sfhpc.weights.paced import PacedLink

                transport = PacedLink(transport, recipe.timing_model.weight_transfer_s)
            self.receiver = WeightReceiver(transport, keep_copy=own_copy or (recipe.engine.staged_updates
                                                                             and not transport.engine_receives))
        self.adapter_merge = None  # LoRA: each version is the adapter alone, merged here into the frozen weights
        if self.receiver is not None and recipe.model.lora is not None and model_dir is not None:
            from sfhpc.weights.adapter import AdapterMerge

            self.adapter_merge = AdapterMerge(model_dir, _engine_dtype(recipe))
        self.playing: list[Future[Any]] = []
        self.quiesced = False  # the engine is paused for good: the rank is stopping
        # The episodes playing now (on the endpoint's loop), each with the trajectory ids it started: what a
        # reclaim hands back. The flag keeps the cut episodes from counting as failed.
        self.held: dict[asyncio.Task[Any], tuple[EpisodeTicket, list[str]]] = {}
        self.reclaiming = False
        self.releasing: set[asyncio.Task[Any]] = set()  # episodes being cut to move elsewhere (`release`)
        self.refusing_turns = False

    # -- the engine's life ----------------------------------------------------------------------------
    async def _start_engine(self, weights: Any = None, version: int = 0) -> RolloutEngine:
        """A new engine in the endpoint's service, holding `weights` as `version` (None: its folder's), watched."""
        with preemption.ignored_in_children():  # the engine's processes leave stop signals to this one
            engine = self.engine_factory()
        if weights is not None:
            await engine.pause()
            await engine.load_weights(weights, version=version)
        await self.endpoint.replace_engine(engine)
        await engine.resume()
        self.watching = asyncio.get_running_loop().create_task(self._watch(engine))
        return engine

    async def _watch(self, engine: RolloutEngine) -> None:
        """When `engine` dies: restart it (up to ``engine.max_restarts`` in the run), or end the run."""
        await engine.wait_dead()
        if self.quiesced or engine is not self.engine:
            return
        limit = self.recipe.engine.max_restarts
        if self.engine_restarts >= limit:
            self.fatal = RuntimeError(
                f"rank {self.rank}: engine '{engine.name}' died (its processes are gone)"
                + (f" after {self.engine_restarts} restarts (engine.max_restarts {limit})" if limit else
                   "; engine.max_restarts restarts it inside the rank"))
            return
        try:
            await self._restart(engine)
        except Exception as exc:  # noqa: BLE001 (any failure to restart ends the run, with its reason)
            self.fatal = RuntimeError(f"rank {self.rank}: engine '{engine.name}' died and did not restart: {exc}")

    async def _restart(self, dead: RolloutEngine) -> None:
        """A new engine in place of `dead`, holding the weights `dead` had (the version the rank's copy holds, or
        its own trainer's, or the folder's); the generations `dead` cut continue on it from their prefix."""
        async with self.engine_lock:
            start = time.perf_counter()
            dead.shutdown()
            version, weights = self._weights_of(dead)
            engine = self.engine = await self._start_engine(weights, version)
            self.engine_restarts += 1
            log.warning("rank %d: engine '%s' restarted with weights of version %d in %.1f s (restart %d of %d)",
                        self.rank, engine.name, engine.version, time.perf_counter() - start, self.engine_restarts,
                        self.recipe.engine.max_restarts)

    def _weights_of(self, dead: RolloutEngine) -> tuple[int, Any]:
        """The version the new engine must hold and its weights (None: the folder's, which a new engine starts
        with): the version `dead` held, or the one a weight update brought while `dead` died under it."""
        version = max(dead.version, self.synced_to)
        if version == 0:
            return 0, None
        if self.trainer is not None:  # colocated or lent: the rank's own trainer holds the policy
            return version, list(self.trainer.named_weights(dtype=_engine_dtype(self.recipe)))
        copy = self.receiver if self.receiver is not None else self.puller
        held = copy.held_weights() if copy is not None else None
        if held is None or held[0] != version:
            raise RuntimeError(f"the rank's copy holds version {None if held is None else held[0]}, the engine "
                               f"must hold {version}")
        return held

    async def _into_engine(self, load: Awaitable[object]) -> None:
        """Await `load` (a weight update into the engine). An engine that dies under it is left to its watch
        (`_watch`): the version is in the rank's copy by then (`apply_version` drains what it did not load),
        and the engine that replaces it starts from there."""
        try:
            await load
        except EngineDied as exc:
            log.warning("rank %d: %s; its weights come from the rank's copy when it restarts", self.rank, exc)

    async def _kill_engine_mid_generation(self) -> None:
        """Fault injection (``engine=kill``): kill the engine's processes 0.1 s into the next generation that lasts
        that long (a step's replies take about 0.2 s in the tests): mid-reply, not after the replies ended."""
        generating_since = None
        while generating_since is None or time.monotonic() - generating_since < 0.1:
            await asyncio.sleep(0.01)
            if not self.endpoint.generating:
                generating_since = None
            elif generating_since is None:
                generating_since = time.monotonic()
        self.engine.kill_processes()

    # -- commands ----------------------------------------------------------------------------------
    def sleep_engine(self) -> None:
        """This rank trains next, on the GPU its engine shares: the engine pauses and gives its memory back
        (vLLM's sleep mode on GPUs; on CPUs a pause). The next weight update or lending wakes it."""
        self.server.call(self.engine.sleep())

    async def _awake(self) -> None:
        if self.engine.sleeping:
            await self.engine.wake_up()
            await self.engine.resume()

    def play(self, episodes: tuple[EpisodeTicket, ...]) -> None:
        fault_injection.strike("play", self.rank)  # a test makes the rank fail here
        if self.refusing_turns:  # lent again after a reclaim: turns are served again (they wait for the wake-up)
            self.refusing_turns = False
            self.server.loop.call_soon_threadsafe(self.endpoint.refuse_turns, False)
        if self.engine.sleeping:  # lent without a weight update since the trainer trained
            self.server.call(self._awake())
        for episode in episodes:
            if episode.resume_id is not None:  # it may come back to a rank that handed it off earlier
                self.server.loop.call_soon_threadsafe(self.endpoint.take_back, episode.resume_id)
            self.playing.append(asyncio.run_coroutine_threadsafe(self._play_held(episode), self.server.loop))

    async def _play_held(self, episode: EpisodeTicket) -> EpisodeOutcome | None:
        task = asyncio.current_task()
        assert task is not None
        started: list[str] = []
        self.held[task] = (episode, started)
        noted = started.append if self.starts is None else _both(started.append, self.starts.claim)
        if self.programs is not None:  # a routed episode's later trajectories (another agent's) go there too
            noted = _both(noted, lambda tid: self._route_if_moved(task, tid))
        try:
            return await self._play(episode, noted)
        finally:
            self.held.pop(task, None)
            self.routed_to.pop(task, None)

    async def _play(self, episode: EpisodeTicket, noted: Callable[[str], None]) -> EpisodeOutcome | None:
        # An agent or task that raises, or outlives budgets.episode_timeout_s, fails its trajectory with the
        # reason (the controller replaces its group): one episode's fault never takes the rank down.
        if self.programs is not None:
            return await self._play_program(episode, self.programs, noted)
        async def play(on_trajectory: Callable[[str], None]) -> EpisodeOutcome:
            on_trajectory = _both(noted, on_trajectory)
            if episode.resume_id is not None:
                on_trajectory(episode.resume_id)
            resume = None if episode.resume_id is None else await self._resume_point(episode)
            return await play_episode(self.backend, self.task, episode.problem, group=episode.group,
                                      seed=episode.seed, max_tokens=self.recipe.budgets.max_new_tokens,
                                      resume=resume, on_trajectory=on_trajectory)

        return await play_or_fail(play, self.manager, task=self.task.name, group=episode.group,
                                  timeout_s=self.recipe.budgets.episode_timeout_s,
                                  stopping=lambda: self._stopping() or asyncio.current_task() in self.releasing)

    async def _play_program(self, episode: EpisodeTicket, programs: AgentPrograms,
                            noted: Callable[[str], None]) -> EpisodeOutcome | None:
        """An episode of the recipe's agent program; its timeout counts from the program's start, not from
        the wait for one of the rank's ``agent.workers`` slots."""
        async def play(on_trajectory: Callable[[str], None]) -> EpisodeOutcome:
            on_trajectory = _both(noted, on_trajectory)
            if episode.resume_id is not None:
                # A program's own state died with the earlier allocation, so its cut trajectory cannot be
                # continued: it is kept as aborted (never trained on) and the episode is played afresh, a
                # new member of the same group.
                await asyncio.to_thread(self.manager.abort, episode.resume_id)
            return await programs.play(self.task, episode.problem, group=episode.group,
                                       max_tokens=reply_budget(self.task, self.recipe.budgets.max_new_tokens),
                                       on_trajectory=on_trajectory, seed=episode.seed)

        assert self.recipe.agent is not None
        timeout_s = self.recipe.agent.timeout_s or self.recipe.budgets.episode_timeout_s
        task = asyncio.current_task()
        # The end counts where the generation is: whoever takes the routing first, the end or `_came_home`, counts it.
        recorder = _EndCountedWhereGenerated(self.manager, lambda: self.routed_to.pop(task, None))  # type: ignore[arg-type]
        async with programs.slots:
            return await play_or_fail(play, recorder, task=self.task.name, group=episode.group,
                                      timeout_s=timeout_s if programs.runner.timed_here else None,
                                      stopping=self._stopping)

    def _stopping(self) -> bool:
        """A stop is under way on this rank (a signal reached it, or the controller quiesced it), or the
        rank is being taken back from rollout: an episode cut now is not a failed one."""
        return self.quiesced or self.reclaiming or preemption.received() is not None

    async def _resume_point(self, episode: EpisodeTicket) -> ResumePoint:
        """An episode of an earlier allocation: its replies so far, the one that was cut short finished
        first from its recorded prefix on this engine (a partial rollout across the restart)."""
        from sfhpc.endpoint.service import Sampling, TurnRequest

        assert episode.resume_id is not None
        trajectory = await asyncio.to_thread(self.manager.trajectory, episode.resume_id)
        tokenizer = self.server.api.tokenizer
        recorded = trajectory.replies()
        replies = [list(tokens) for tokens, _ in recorded]
        cut = bool(recorded) and recorded[-1][1]
        context = tuple(int(t) for t in trajectory.context())
        generated = tuple(bool(g) for g in trajectory.generated_mask())
        # The cut reply keeps its own turn's budget (the problem may bound it below the task-wide one).
        earlier = [self.server.api.reply_message(r, self.task.tools) for r in replies[:-1]]
        budget = resumed_turn_budget(self.task, episode.problem, earlier, self.recipe.budgets.max_new_tokens)
        remaining = budget - (len(replies[-1]) if cut else 0)
        if cut and remaining > 0:
            # The continuation samples as the cut reply did: one reply, one temperature to train it at.
            cut_run = trajectory.segments[trajectory.reply_spans()[-1][-1][0]]
            temperature = self.recipe.algorithm.temperature if cut_run.temperature is None else cut_run.temperature
            request = TurnRequest(tuple(int(t) for t in trajectory.context()), trajectory_id=trajectory.id,
                                  task=trajectory.task, group=trajectory.group,
                                  sampling=Sampling(max_tokens=remaining, seed=episode.seed + len(replies),
                                                    temperature=temperature,
                                                    stop_token_ids=tuple(tokenizer.chat_stop_ids)))
            result = await self.endpoint.complete(request)
            replies[-1] += result.token_ids
            context += tuple(result.token_ids)
            generated += (True,) * len(result.token_ids)
        # The replayed episode sends its earlier replies back as text; this endpoint continues the recorded
        # tokens when that text says the same in other tokens (a BPE spelling), as for a turn of its own.
        self.server.api.history.adopt(trajectory.id, context, generated)
        return ResumePoint(trajectory.id, tuple(self.server.api.reply_message(r, self.task.tools) for r in replies))

    def sync_weights(self, version: int) -> float:
        """Bring the engine to `version`; returns the seconds the engine was paused.

        Disaggregated: the weights arrive over the broadcast group; `apply_version` pauses, loads them
        bucket by bucket and resumes (with ``engine.staged_updates`` they come in first while the engine goes on
        generating, `receive_beside`, and the pause only loads them). Colocated: this rank's own trainer holds
        them. `paused_at` says when the pause began (the run's timeline)."""
        from sfhpc.engine.weight_sync import apply_version, header_arrived, next_version, receive_beside

        async def from_broadcast() -> float:
            assert self.receiver is not None
            await header_arrived(self.receiver)
            async with self.engine_lock:
                incoming = await next_version(self.receiver)
                if hold := fault_injection.hold_seconds("broadcast"):
                    await asyncio.sleep(hold)  # a test stretches the broadcast to signal the job inside it
                if incoming is None or incoming.version != version:
                    raise RuntimeError(f"rank {self.rank}: expected weights version {version}, got "
                                       f"{None if incoming is None else incoming.version}")
                self.synced_to = version
                staged = await receive_beside(self.engine, incoming) if self.recipe.engine.staged_updates \
                    else incoming  # staged: the engine goes on generating while the version comes in
                start = time.perf_counter()
                self.paused_at = time.time()
                await self._into_engine(apply_version(self.engine, staged, self.adapter_merge))
                seconds = time.perf_counter() - start
            if version >= 2 and fault_injection.engine_fault(self.rank):
                asyncio.get_running_loop().create_task(self._kill_engine_mid_generation())
            return seconds

        async def from_server() -> float:
            assert self.puller is not None
            async with self.engine_lock:
                incoming = await asyncio.to_thread(self.puller.pull, version)  # the engine generates meanwhile
                if incoming is None or incoming.version != version:
                    raise RuntimeError(f"rank {self.rank}: expected weights version {version} from the weight "
                                       f"server, got {None if incoming is None else incoming.version}")
                start = time.perf_counter()
                self.paused_at = time.time()
                self.synced_to = version
                await self._into_engine(apply_version(self.engine, incoming))
                return time.perf_counter() - start

        async def from_own_trainer() -> float:
            assert self.trainer is not None
            start = time.perf_counter()
            self.paused_at = time.time()
            self.synced_to = version
            await self._into_engine(self._own_trainers_weights(version))
            return time.perf_counter() - start

        if self.trainer is not None:
            return self.server.call(from_own_trainer())
        return self.server.call(from_server() if self.puller is not None else from_broadcast())

    async def _own_trainers_weights(self, version: int) -> None:
        """The engine to `version` from this rank's own trainer (colocated or lent)."""
        assert self.trainer is not None
        await self.engine.pause()
        await self.engine.wake_up()  # asleep while the trainer trained: the memory back first
        await self.engine.load_weights(self.trainer.named_weights(dtype=_engine_dtype(self.recipe)), version=version)
        await self.engine.resume()

    def catch_up(self) -> int:
        """A worker of another job, just started: its engine to the latest version the trainer published (the
        folder's weights when none was); returns the version it holds."""
        from sfhpc.engine.weight_sync import apply_version

        async def latest() -> int:
            assert self.puller is not None
            async with self.engine_lock:
                incoming = await asyncio.to_thread(self.puller.pull)
                if incoming is not None:
                    self.synced_to = incoming.version
                    await self._into_engine(apply_version(self.engine, incoming))
                return max(self.synced_to, self.engine.version)

        return self.server.call(latest())

    def errors(self) -> list[BaseException]:
        """Exceptions of finished episodes (an agent that crashed must not go unnoticed), and a dead engine that
        was not restarted."""
        done = [f for f in self.playing if f.done() and not f.cancelled()]  # cancelled: moved by a reclaim
        self.playing = [f for f in self.playing if not f.done()]
        return ([self.fatal] if self.fatal is not None else []) + [
            e for e in (f.exception() for f in done) if e is not None]

    def end_weight_stream(self) -> None:
        """On Stop the first trainer closes the weight stream: take its last header, so that no broadcast
        is left posted when MPI finalizes."""
        if self.receiver is not None and (incoming := self.receiver.receive()) is not None:
            incoming.drain()
            raise RuntimeError(f"rank {self.rank}: weights version {incoming.version} arrived after Stop")

    def quiesce(self) -> int:
        """Pause the engine for good: every generation in flight ends and is recorded as a partial rollout
        (the turns record their segment and interrupt the trajectory); returns how many were cut. A round
        trip on the manager link then makes sure those one-way records have reached the manager."""
        self.quiesced = True
        cut = self.server.call(self.endpoint.quiesce(), timeout=60)
        self.manager.counts()
        return cut

    def cancel(self, groups: Iterable[str]) -> tuple[int, tuple[int, ...]]:
        """Stop the episodes of `groups`, which the run dropped as stale while they played: their turns are
        cancelled (the generations end on the engine) and so are the episodes. Returns how many were still
        playing, and for those whose generations were routed to another rank, that rank (their count's)."""
        return self.server.call(self._cancel(frozenset(groups)), timeout=60)

    async def _cancel(self, groups: frozenset[str]) -> tuple[int, tuple[int, ...]]:
        doomed = {task: started for task, (episode, started) in self.held.items()
                  if episode.group in groups and not task.done()}
        routed = tuple(self.routed_to[task] for task in doomed if task in self.routed_to)
        self.endpoint.cancel_turns(tid for started in doomed.values() for tid in started)
        for task in doomed:
            task.cancel()
        await asyncio.gather(*doomed, return_exceptions=True)
        return len(doomed), routed

    def reclaim(self, to: tuple[int, ...] = ()) -> tuple[int, tuple[EpisodeTicket, ...], tuple[int, ...]]:
        """This trainer rank goes back to training: every generation in flight is cut at a token boundary
        and recorded as a partial rollout, every episode still playing is dropped here, and the engine runs
        again for the next lending. Returns how many generations were cut and the dropped episodes, each
        naming its trajectory (``resume_id``) where one started, for the controller to continue elsewhere.
        Agent programs' episodes stay, their generations routed to the ranks of `to` in turn (the rank's
        endpoint goes on serving their programs while it trains); the last item names, per such episode, the
        rank its generation went to."""
        self.reclaiming = True
        try:
            cut, moved, routed = self.server.call(self._reclaim(to), timeout=90)
        finally:
            self.reclaiming = False
        self.refusing_turns = True
        self.manager.counts()  # a round trip: the cut segments' one-way records have reached the manager
        return cut, moved, routed

    def release(self, count: int, to: tuple[int, ...] = ()) -> tuple[tuple[EpisodeTicket, ...], tuple[int, ...]]:
        """Cut up to `count` episodes now playing here, those handed out first (the oldest groups: they hold
        the batch back), at a token boundary: each records what it generated as a partial rollout and leaves
        this rank without counting as failed; the engine runs on for the others. Episodes of the task's own
        agent are released if their trajectory started; returns them, each naming its trajectory
        (``resume_id``), for the controller to continue elsewhere. An agent program's episode stays (its state
        is in the program) and its generation moves to the ranks of `to` in turn; returns, per such episode,
        the rank it went to."""
        if count < 1:
            return (), ()
        if self.programs is not None:
            return (), self.server.call(self._route_programs(count, to), timeout=60)
        return self.server.call(self._release(count), timeout=60), ()

    async def _route_programs(self, count: int, to: tuple[int, ...]) -> tuple[int, ...]:
        """Route the generations of up to `count` agent programs' episodes playing here (the oldest first, none
        routed already) to the ranks of `to`, one each in turn: their running turns are cut at a token boundary
        and continue there from their prefix (`AgentEndpoint.route`). Returns the rank of each routed one."""
        if self.engine_doors is None or not to:
            return ()
        targets = iter(to[:count])
        routed = []
        for task, (_, started) in list(self.held.items()):
            if task.done() or task in self.routed_to:
                continue
            target = next(targets, None)
            if target is None:
                break
            self.routed_to[task] = target
            self.endpoint.route(started, self._remote(target))
            routed.append(target)
        return tuple(routed)

    def _route_if_moved(self, task: asyncio.Task[Any], trajectory_id: str) -> None:
        if (target := self.routed_to.get(task)) is not None:
            self.endpoint.route([trajectory_id], self._remote(target))

    def _remote(self, rank: int) -> RemoteEngine:
        assert self.remotes is not None
        return self.remotes.of(rank)

    def _came_home(self, rank: int) -> None:
        """Rank `rank` takes no more generations of this rank's programs: those routed there generate here again
        (`AgentEndpoint.engine_for`), and are counted in flight here from now on, not there."""
        for task, target in list(self.routed_to.items()):
            if target == rank and self.routed_to.pop(task, None) is not None:
                self.manager.generation_came_home(rank)

    async def _release(self, count: int) -> tuple[EpisodeTicket, ...]:
        chosen: dict[asyncio.Task[Any], tuple[EpisodeTicket, list[str]]] = {}
        for task, (episode, started) in self.held.items():
            if len(chosen) == count:
                break
            # An episode's trajectory: the one its agent heard of, or the one its first turn runs now.
            trajectory = started[0] if started else self.endpoint.turn_trajectory(task)
            if trajectory is not None and not task.done():
                chosen[task] = (episode, [trajectory])
        return await self._move_out(chosen)

    async def _reclaim(self, to: tuple[int, ...]) -> tuple[int, tuple[EpisodeTicket, ...], tuple[int, ...]]:
        routed = await self._route_programs(len(self.held), to)  # first: their generations move, they stay
        cut = await self.endpoint.quiesce(routes=False)  # every generation on this engine cut at once
        self.endpoint.refuse_turns(True)  # turns of HTTP agents (not tasks of this rank's own) give up too
        assert self.starts is not None, "reclaim is for lendable ranks"
        unnamed = self.starts.unclaimed()  # group -> trajectories started here whose agent never heard the id
        chosen: dict[asyncio.Task[Any], tuple[EpisodeTicket, list[str]]] = {}
        for task, (episode, started) in self.held.items():
            if task in self.routed_to:
                continue  # its program plays on here
            if not started and unnamed.get(episode.group):
                # Members of a group are alike (one problem, seeds of their own): an episode cut in its first
                # turn takes any such trajectory of its group, each one once.
                started = [unnamed[episode.group].pop()]
            chosen[task] = (episode, list(started))
        moved = await self._move_out(chosen)
        await self.engine.resume()
        self.starts.clear()  # nothing plays on this engine any more
        return cut, moved, routed

    async def _move_out(self, chosen: dict[asyncio.Task[Any], tuple[EpisodeTicket, list[str]]]
                        ) -> tuple[EpisodeTicket, ...]:
        """The one way an episode leaves this rank to continue on another (release, reclaim): its trajectories
        are handed off at the endpoint (their running turns, HTTP handlers too, cut and recorded; later turns
        refused), then its task is cancelled without counting as failed. Returns the tickets of those that
        had not finished meanwhile, each naming its trajectory (``resume_id``) where one started, for the
        controller to continue elsewhere (an agent program's names none: its trajectories are aborted here
        and it is played afresh). (The caller's round trip to the manager makes sure the cut
        segments' one-way records arrived before the controller hands the episodes out.)"""
        self.releasing.update(chosen)  # first: a cut turn fails its agent's call, which is no failed episode
        try:
            await self.endpoint.hand_off(tid for _, ids in chosen.values() for tid in ids)
            for task in chosen:
                task.cancel()
            outcomes = await asyncio.gather(*chosen, return_exceptions=True)
        finally:
            self.releasing.clear()
        moved = []
        for (episode, started), outcome in zip(chosen.values(), outcomes):
            if isinstance(outcome, EpisodeOutcome):
                continue  # finished before the cut: it stays
            if self.programs is not None:
                # An agent program's state died with it: its trajectories (every agent's, every choice's) are
                # kept as aborted, never trained on, and the episode is played afresh elsewhere.
                for trajectory in started:
                    await asyncio.to_thread(self.manager.abort, trajectory)
                moved.append(episode)
            else:
                moved.append(dataclasses.replace(episode, resume_id=started[0]) if started else episode)
        return tuple(moved)

    async def _wind_down_episodes(self) -> None:
        """Wait (bounded) until the cancelled episodes have ended (an agent program's launcher ends all it
        started within milliseconds), then end the serving programs: no program, nor a task reading its
        pipes, outlives the loop (asyncio would complain of each on the console)."""
        if self.held:
            await asyncio.wait(list(self.held), timeout=STOP_GRACE_S + 2)
        if self.programs is not None:
            await self.programs.close()

    def close(self) -> None:
        """Wind down in dependency order: engine paused (what is in flight is recorded), agents, HTTP site
        (its open requests still need the engine), engine (on its own loop), event loop, and last the
        manager link (the controller serves it until every rollout rank has said goodbye)."""
        self.quiesced = True
        try:
            self.server.call(self.endpoint.quiesce(), timeout=60)
        except Exception as exc:  # noqa: BLE001 - a dead engine must not keep the rank from closing down
            log.warning("rank %d: engine did not pause at close (%s)", self.rank, exc)
        self.server.loop.call_soon_threadsafe(self.endpoint.close)  # waiting turns give up: the site can close
        for future in self.playing:
            future.cancel()
        try:
            self.server.call(self._wind_down_episodes(), timeout=STOP_GRACE_S + 10)
        except Exception as exc:  # noqa: BLE001 - the launchers die with the rank: the rank must close
            log.warning("rank %d: episodes did not end at close (%s)", self.rank, exc)
        self.server.close_site()
        if self.door is not None:
            self.door.close()
        if self.remotes is not None:
            self.remotes.shutdown()
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            async def stop_engine() -> None:
                shutdown()  # on the engine's own loop: vLLM cancels its output task there

            self.server.call(stop_engine(), timeout=120)

        async def stop_watching() -> None:
            self.watching.cancel()  # (the engine is gone on purpose)

        self.server.call(stop_watching(), timeout=10)
        self.server.stop()
        self.manager.close()


class _StartsByGroup:
    """The trajectory sink (the manager's client) with a note of the trajectories started through it, by
    group, and of those an agent has heard of (`claim`)."""

    def __init__(self, sink: Any) -> None:
        self._sink = sink
        self._started: dict[str, list[str]] = {}
        self._claimed: set[str] = set()

    def start(self, prompt_tokens: Any, *, task: str = "", group: str | None = None, metadata: Any = None,
              trajectory_id: str | None = None) -> str:
        made = self._sink.start(prompt_tokens, task=task, group=group, metadata=metadata, trajectory_id=trajectory_id)
        self._started.setdefault(group or "", []).append(made)
        return made

    def claim(self, trajectory_id: str) -> None:
        self._claimed.add(trajectory_id)

    def unclaimed(self) -> dict[str, list[str]]:
        return {g: [t for t in ids if t not in self._claimed] for g, ids in self._started.items()}

    def clear(self) -> None:
        self._started.clear()
        self._claimed.clear()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sink, name)  # every other call goes to the sink as it is


class _EndCountedWhereGenerated:
    """The trajectory sink of an agent program's episode: its end counts for the rank its generation was routed
    to, if it still is (`target()`: that rank, or None, taking the routing so that a later coming home does
    not count it again), where the scheduler counts it in flight."""

    def __init__(self, sink: Any, target: Callable[[], int | None]) -> None:
        self._sink, self._target = sink, target

    def finish_episode(self, *args: Any, **kwargs: Any) -> None:
        self._sink.finish_episode(*args, **kwargs, counts_for=self._target())

    def fail_episode(self, *args: Any, **kwargs: Any) -> None:
        self._sink.fail_episode(*args, **kwargs, counts_for=self._target())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sink, name)


def _both(first: Callable[[str], None], second: Callable[[str], None]) -> Callable[[str], None]:
    def call(trajectory_id: str) -> None:
        first(trajectory_id)
        second(trajectory_id)

    return call


def _endpoint_address(recipe: Recipe) -> dict[str, Any]:
    """Where the endpoint listens: loopback, unless the recipe's agent programs reach it from elsewhere."""
    agent = recipe.agent
    if agent is None:
        return {}
    return {"host": agent.bind_address(recipe.agent_hosts is not None), "port": agent.port,
            "advertise_host": agent.advertise_host}


def _engine_dtype(recipe: Recipe) -> Any:
    import torch

    return getattr(torch, recipe.model.dtype)


class _Idle(RolloutEngine):
    """Stands in until the real engine has started on the endpoint's loop; it never generates."""

    def __init__(self) -> None:
        super().__init__("starting")

    @property
    def max_model_len(self) -> int:
        return 1

    async def generate(self, request: Any) -> Any:  # pragma: no cover - replaced before any agent runs
        raise RuntimeError("the engine has not started yet")
        yield

    async def abort(self, request_id: str) -> None:
        return None

    async def _pause_generation(self) -> None:
        return None

    async def _resume_generation(self) -> None:
        return None

    async def _load_weights(self, weights: Any) -> None:
        return None


def model_dir_of(run_dir: Path) -> Path:
    return RunPaths(run_dir).model
