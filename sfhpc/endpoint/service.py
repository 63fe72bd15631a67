"""The endpoint's core: one agent turn = record the prompt, generate, record the output, survive pauses.

`AgentEndpoint` sits between agents and one rollout engine and writes every turn into a
`TrajectorySink`. It knows nothing about HTTP (the server and the in-process client are thin layers on
top), so both kinds of agent get the same semantics:

- a turn of an existing trajectory ``observe``s its full prompt (the sink appends the new suffix, or
  branches), a turn without a trajectory id ``start``s a new trajectory;
- turns of one trajectory run one at a time, in arrival order;
- when the engine is paused (weight swap) or replaced (its rank is taken back), a generation ends with
  ``abort``. The turn records the partial segment (``add_generated(..., finish_reason="abort")``, then
  ``interrupt``), waits until an engine runs again and resubmits ``prompt + partial`` with the
  remaining budget. The agent receives one completion; the sink holds one segment per engine run, each
  token with the weight version that produced it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any, TypeVar

from sfhpc.data.errors import TrajectoryConflict, UnknownTrajectory
from sfhpc.data.groups import is_evaluation
from sfhpc.endpoint.errors import (
    BadRequest,
    ContextLengthExceeded,
    ShuttingDown,
    TrajectoryClosed,
    TrajectoryNotFound,
    from_sink_error,
)
from sfhpc.endpoint.sink import TrajectorySink
from sfhpc.engine.base import FinishReason, GenerationRequest, RolloutEngine
from sfhpc.errors import SfhpcError

T = TypeVar("T")
log = logging.getLogger("sfhpc")


# OpenAI's defaults, for a turn that asks for no temperature or top-p (and no rule gives another).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How to sample one turn. ``max_tokens=None`` means: as many as the context has room for;
    ``temperature`` / ``top_p`` None: the agent asked for none (the run's default applies, see
    `SamplingRule`, else OpenAI's). What the turn was sampled with is recorded on its segments."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def resolved(self, default_temperature: float = DEFAULT_TEMPERATURE) -> Sampling:
        """This sampling with a default wherever the agent asked for none."""
        return dataclasses.replace(
            self, temperature=default_temperature if self.temperature is None else self.temperature,
            top_p=DEFAULT_TOP_P if self.top_p is None else self.top_p)


@dataclasses.dataclass(frozen=True)
class SamplingRule:
    """The sampling an RL run can train on, and its default temperature (``algorithm.temperature``).

    The trainers score every generated token at the temperature it was sampled with (the segment records
    it), over the whole vocabulary. So any temperature above 0 is served and trained on as it is; refused
    with a 400 (``unsupported_sampling``), before anything is generated or recorded, is what the trainers
    cannot reproduce: greedy decoding (temperature 0: a deterministic choice has no sampling logprob to
    correct with) and a top-p nucleus below 1 (the trainers' logprobs are over the whole vocabulary; a
    nucleus cut recomputed from float32 logits would not fall where the engine's did).

    An evaluation episode's turns (its group: `sfhpc.data.groups.is_evaluation`) are never trained on: they
    default to `evaluation_temperature` and may sample as they ask, greedy included."""

    default_temperature: float = DEFAULT_TEMPERATURE
    evaluation_temperature: float | None = None  # None: the run evaluates nothing

    def apply(self, sampling: Sampling, group: str | None = None) -> Sampling:
        """`sampling` with this run's defaults where the agent asked for none; a 400 for what cannot be
        trained on (a turn of `group`, an evaluation's, is not)."""
        if self.evaluation_temperature is not None and is_evaluation(group):
            return sampling.resolved(self.evaluation_temperature)
        resolved = sampling.resolved(self.default_temperature)
        assert resolved.temperature is not None and resolved.top_p is not None
        if resolved.temperature == 0:
            raise BadRequest("temperature 0 (greedy decoding) cannot be trained on: a deterministic choice has no "
                             "sampling probability for the trainer to compare with; send a temperature above 0 "
                             f"or leave it out (this run's default is {self.default_temperature:g})",
                             param="temperature", code="unsupported_sampling")
        if resolved.top_p != 1.0:
            raise BadRequest(f"top_p {resolved.top_p:g} cannot be trained on: the trainer computes logprobs over the "
                             "whole vocabulary, not a nucleus; leave top_p out (or send 1) and lower the "
                             "temperature instead", param="top_p", code="unsupported_sampling")
        return resolved


@dataclasses.dataclass(frozen=True)
class TurnRequest:
    """One agent call. ``trajectory_id`` names the existing trajectory it continues; without one, the call
    starts a new trajectory, under ``start_id`` if given (a client's own session id). ``prompt_param`` names
    the request field the prompt came from (for error messages)."""

    prompt_token_ids: tuple[int, ...]
    sampling: Sampling = Sampling()
    trajectory_id: str | None = None
    start_id: str | None = None
    task: str = ""
    group: str | None = None
    metadata: dict[str, Any] | None = None
    prompt_param: str = "prompt"
    # A stop condition of the agent's (OpenAI's ``stop`` strings): makes one matcher per turn, which is fed
    # the reply's new token ids as they arrive (across pauses too) and says whether the reply so far has met
    # it: the generation ends there with "stop", its tokens kept as generated. Fed only what is new, a matcher
    # works in time linear in the reply (`sfhpc.endpoint.protocol.StopMatcher`).
    stop_when: Callable[[], Callable[[Sequence[int]], bool]] | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class TokenDelta:
    """Tokens the agent has not seen yet, as they stream."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class TurnResult:
    """The whole completion of one turn (across any pauses) and how it was produced."""

    trajectory_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: FinishReason
    interruptions: int  # engine runs that ended in a pause and were continued


class AgentEndpoint:
    """Turns of agents against one engine (replaceable) and one trajectory sink.

    All methods run on the event loop that owns the engine; the sink is called from that loop's thread
    only, so a sink need not be thread-safe.
    """

    def __init__(self, engine: RolloutEngine, sink: TrajectorySink) -> None:
        self._engine = engine
        self.sink = sink
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self._request_ids = itertools.count()
        self._engine_changed = asyncio.Event()
        self._in_engine = 0  # turns with a generation running on the engine (not waiting for a resume)
        self._closing = asyncio.Event()
        self._refusing = False  # turns give up instead of waiting: the rank was taken back from rollout
        self._turn_tasks: dict[str, set[asyncio.Task[Any]]] = {}  # trajectory -> the tasks running its turns
        self._handed_off: set[str] = set()  # trajectories moved to another rank: their turns are refused here
        self.refused_after_hand_off = 0  # turns refused for that (a late call of a moved episode's agent)
        # Trajectories whose generations run on another engine (an agent program's episode moved: `route`), and
        # the generation each trajectory runs now (its engine and request), which a route cuts.
        self._routes: dict[str, RolloutEngine] = {}
        self._running: dict[str, tuple[RolloutEngine, str]] = {}

    @property
    def engine(self) -> RolloutEngine:
        return self._engine

    @property
    def generating(self) -> int:
        """Turns with a generation running on the engine now (not those routed elsewhere)."""
        return self._in_engine

    def engine_for(self, trajectory_id: str) -> RolloutEngine:
        """The engine that generates `trajectory_id`'s turns: the one it is routed to (`route`) while that one
        takes them, else this endpoint's own."""
        routed = self._routes.get(trajectory_id)
        if routed is not None and getattr(routed, "gone", None) is not None:
            del self._routes[trajectory_id]  # its rank takes no more: the generation comes home
            routed = None
        return self._engine if routed is None else routed

    def route(self, trajectory_ids: Iterable[str], engine: RolloutEngine) -> int:
        """From now on these trajectories' turns generate on `engine` (another rank's, `sfhpc.engine.remote`),
        while their agents' calls stay here: a generation running now is cut at a token boundary (its tokens
        recorded) and continues there from its prefix, and a turn waiting for this endpoint's engine goes there
        at once. Returns how many generations were cut."""
        cut = 0
        for tid in trajectory_ids:
            self._routes[tid] = engine
            running = self._running.get(tid)
            if running is not None and running[0] is not engine:
                asyncio.get_running_loop().create_task(running[0].abort(running[1]))
                cut += 1
        self._engine_changed.set()  # (as `replace_engine`: waiting turns look again)
        self._engine_changed = asyncio.Event()
        return cut

    def routed(self) -> dict[str, RolloutEngine]:
        """The trajectories routed to other engines now (`route`), those that still take them."""
        return {tid: engine for tid in list(self._routes) if (engine := self.engine_for(tid)) is not self._engine}

    def turn(self, request: TurnRequest) -> Turn:
        """``async with endpoint.turn(req) as turn: async for delta in turn.stream(): ...``; then ``turn.result``."""
        return Turn(self, request)

    async def complete(self, request: TurnRequest) -> TurnResult:
        """One turn, without streaming."""
        async with self.turn(request) as turn:
            async for _ in turn.stream():
                pass
            assert turn.result is not None
            return turn.result

    async def update_weights(self, weights: Iterable[tuple[str, Any]], *, version: int | None = None) -> int:
        """Pause the engine, load `weights`, resume; in-flight turns continue on the new weights."""
        engine = self._engine
        await engine.pause()
        try:
            return await engine.load_weights(weights, version=version)
        finally:
            await engine.resume()

    async def quiesce(self, timeout: float = 10.0, *, routes: bool = True) -> int:
        """Pause the engine and return once every turn has recorded what it generated (each ends its
        engine run with ``abort``, records the partial segment and interrupts its trajectory, then waits
        for a resume that a stopping rank never gives). With `routes`, the generations routed to other
        engines (`route`) are cut too (a stop); without, they go on (a lent rank taken back keeps serving the
        programs whose generations it moved). Returns how many generations were cut here."""
        cut = self._in_engine
        if routes:
            for engine in set(self.routed().values()):
                await engine.pause()
        await self._engine.pause()
        deadline = asyncio.get_running_loop().time() + timeout
        while self._in_engine and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.005)
        if self._in_engine:
            log.warning("%d generations still on engine '%s' %.0f s after it paused", self._in_engine,
                        self._engine.name, timeout)
        return cut

    def close(self) -> None:
        """Turns waiting for a paused engine give up (HTTP 503), so that the server can close: a stopping
        rank never resumes its engine. What they generated is already recorded."""
        self._closing.set()

    def refuse_turns(self, refusing: bool) -> None:
        """While refusing, turns give up (HTTP 503, as at `close`) instead of waiting for the paused engine,
        new ones too: a trainer rank taken back from rollout hands its trajectories, recorded so far, to other
        ranks. Turns waiting now are woken to give up."""
        self._refusing = refusing
        if refusing:
            self._engine_changed.set()
            self._engine_changed = asyncio.Event()

    def cancel_turns(self, trajectory_ids: Iterable[str]) -> int:
        """Cancel the turns running now for these trajectories (their generations end on the engine; an HTTP
        agent's call fails): the run dropped them. Returns how many turns were cancelled."""
        tasks = {task for tid in trajectory_ids for task in self._turn_tasks.get(tid, ())}
        for task in tasks:
            task.cancel()
        return len(tasks)

    async def hand_off(self, trajectory_ids: Iterable[str], timeout: float = 30.0) -> int:
        """These trajectories move to another rank: from now on this endpoint refuses their turns (HTTP 503,
        counted in `refused_after_hand_off`), and the turns running now are cancelled and awaited, each
        recording what it generated (a partial segment, ``abort``) before this returns. An HTTP handler would
        otherwise go on generating after its agent's call was cancelled (aiohttp does not cancel a handler
        when its peer goes away) and append a whole reply to a trajectory another rank continues. Returns
        how many turns were cut."""
        ids = set(trajectory_ids)
        self._handed_off |= ids
        running = {task for tid in ids for task in self._turn_tasks.get(tid, ()) if task is not asyncio.current_task()}
        for task in running:
            task.cancel()
        if running:
            _, late = await asyncio.wait(running, timeout=timeout)
            if late:
                log.warning("%d turns of moved trajectories still running %.0f s after they were cancelled",
                            len(late), timeout)
        return len(running)

    def take_back(self, trajectory_id: str) -> None:
        """A trajectory handed off earlier continues here again: its turns are served."""
        self._handed_off.discard(trajectory_id)

    def turn_trajectory(self, task: asyncio.Task[Any]) -> str | None:
        """The trajectory whose turn `task` runs now (None: it runs none), before its agent may have heard the
        id (that comes with the reply)."""
        return next((tid for tid, tasks in self._turn_tasks.items() if task in tasks), None)

    async def replace_engine(self, engine: RolloutEngine) -> RolloutEngine:
        """Move to `engine`: the old one is paused (and returned, still paused) and every in-flight turn
        continues on the new one from where it stopped."""
        old, self._engine = self._engine, engine
        # Wake turns that wait for the old engine to resume: they must move, not wait.
        self._engine_changed.set()
        self._engine_changed = asyncio.Event()
        await old.pause()
        return old

    async def running_engine(self) -> RolloutEngine:
        """This endpoint's engine once it is not paused; `ShuttingDown` when the rank takes no more turns (it is
        stopping, or was taken back from rollout). What another rank's routed generations run on."""
        return await self._running_engine()

    # -- internals used by Turn ------------------------------------------------------------------
    def _next_request_id(self) -> str:
        return f"gen-{next(self._request_ids)}"

    async def _running_engine(self, trajectory_id: str | None = None) -> RolloutEngine:
        """The engine that generates `trajectory_id`'s turns (`engine_for`; None: this endpoint's own) once it
        is not paused (following replacements and routes while waiting)."""
        while True:
            changed = self._engine_changed
            engine = self._engine if trajectory_id is None else self.engine_for(trajectory_id)
            if self._closing.is_set():
                raise ShuttingDown("the rollout rank is stopping; the trajectory continues after a restart")
            if self._refusing and engine is self._engine:
                raise ShuttingDown("the rank was taken back from rollout; the trajectory continues on another rank")
            if not engine.paused:
                return engine
            resumed = asyncio.ensure_future(engine.wait_resumed())
            moved = asyncio.ensure_future(changed.wait())
            closing = asyncio.ensure_future(self._closing.wait())
            try:
                await asyncio.wait({resumed, moved, closing}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                resumed.cancel()
                moved.cancel()
                closing.cancel()

    async def _lock(self, trajectory_id: str) -> asyncio.Lock:
        lock, users = self._locks.get(trajectory_id, (asyncio.Lock(), 0))
        self._locks[trajectory_id] = (lock, users + 1)
        try:
            await lock.acquire()
        except BaseException:
            self._forget(trajectory_id)
            raise
        return lock

    def _forget(self, trajectory_id: str) -> None:
        lock, users = self._locks[trajectory_id]
        if users == 1:
            del self._locks[trajectory_id]
        else:
            self._locks[trajectory_id] = (lock, users - 1)

    def _unlock(self, trajectory_id: str) -> None:
        self._locks[trajectory_id][0].release()
        self._forget(trajectory_id)

    def _sink_call(self, trajectory_id: str, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return call(*args, **kwargs)
        except SfhpcError as exc:
            raise from_sink_error(exc, trajectory_id) from exc


class Turn:
    """One agent call in progress; see `AgentEndpoint.turn`."""

    def __init__(self, endpoint: AgentEndpoint, request: TurnRequest) -> None:
        self._endpoint = endpoint
        self.request = request
        self.trajectory_id = ""
        self.result: TurnResult | None = None
        self._locked = False
        self._task: asyncio.Task[Any] | None = None
        self._stream: AsyncIterator[TokenDelta] | None = None
        self._max_new = 0
        self._sampling = request.sampling.resolved()  # what the engine is asked for, and what is recorded

    async def __aenter__(self) -> Turn:
        ep, req = self._endpoint, self.request
        limit = ep.engine.max_model_len
        prompt_len = len(req.prompt_token_ids)
        if prompt_len == 0:
            raise ContextLengthExceeded("the prompt is empty; send at least one token", param=req.prompt_param,
                                        code="empty_prompt")
        if prompt_len >= limit:
            raise ContextLengthExceeded(
                f"the prompt has {prompt_len} tokens but the model's context holds {limit}, including at least "
                f"one generated token; shorten the prompt", param=req.prompt_param)
        room = limit - prompt_len
        # More max_tokens than the context has room for is not an error: the turn ends with 'length'.
        self._max_new = room if req.sampling.max_tokens is None else min(req.sampling.max_tokens, room)
        tid = req.trajectory_id
        if tid is None and req.start_id is not None:
            # The client's own id may clash with a trajectory the run holds: the manager's answer is awaited
            # (a round trip to another rank), from a worker thread so that the loop keeps serving.
            try:
                self.trajectory_id = await asyncio.to_thread(
                    ep.sink.start, list(req.prompt_token_ids), task=req.task, group=req.group,
                    metadata=req.metadata, trajectory_id=req.start_id)
            except SfhpcError as exc:
                raise from_sink_error(exc, req.start_id) from exc
            await self._hold()
            return self
        if tid is None:
            self.trajectory_id = ep._sink_call("", ep.sink.start, list(req.prompt_token_ids), task=req.task,
                                               group=req.group, metadata=req.metadata)
            await self._hold()
            return self
        self.trajectory_id = tid
        await self._hold()
        try:
            if tid in ep._handed_off:
                ep.refused_after_hand_off += 1
                log.info("a turn of trajectory %s refused: it moved to another rank", tid)
                raise ShuttingDown(f"trajectory {tid!r} moved to another rank; its turns continue there")
            try:
                # One call records the turn and answers "is it known, is it open" (the manager refuses both).
                # It may be a round trip to another rank: made from a worker thread, so the loop keeps
                # serving the other agents and the engine meanwhile.
                await asyncio.to_thread(ep.sink.observe, tid, list(req.prompt_token_ids))
            except UnknownTrajectory:
                raise TrajectoryNotFound(f"trajectory {tid!r} is unknown; omit the id to start a new one",
                                         param="trajectory_id") from None
            except TrajectoryConflict as exc:
                raise TrajectoryClosed(f"trajectory {tid!r} takes no more turns ({exc}); start a new one",
                                       param="trajectory_id") from None
            except SfhpcError as exc:
                raise from_sink_error(exc, tid) from exc
        except BaseException:
            self._release()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            if self._stream is not None:
                await self._stream.aclose()  # type: ignore[attr-defined]  # records a cut-off turn
        finally:
            self._release()

    async def _hold(self) -> None:
        """Take the trajectory's lock (its turns run one at a time) and note the task running this turn, for
        `AgentEndpoint.cancel_turns`; `_release` gives both back."""
        await self._endpoint._lock(self.trajectory_id)
        self._locked = True
        self._task = asyncio.current_task()
        if self._task is not None:
            self._endpoint._turn_tasks.setdefault(self.trajectory_id, set()).add(self._task)

    def _release(self) -> None:
        if self._task is not None:
            tasks = self._endpoint._turn_tasks.get(self.trajectory_id, set())
            tasks.discard(self._task)
            if not tasks:
                self._endpoint._turn_tasks.pop(self.trajectory_id, None)
            self._task = None
        if self._locked:
            self._locked = False
            self._endpoint._unlock(self.trajectory_id)

    def stream(self) -> AsyncIterator[TokenDelta]:
        """New tokens as the engine makes them; ``result`` is set when the iterator ends."""
        if self._stream is not None:
            raise RuntimeError("a turn streams once")
        self._stream = self._generate()
        return self._stream

    def _record(self, tokens: Sequence[int], logprobs: Sequence[float], versions: Sequence[int],
                engine: RolloutEngine, finish_reason: str) -> None:
        ep, tid, s = self._endpoint, self.trajectory_id, self._sampling
        if tokens:
            # The sampling goes with the tokens: the trainer scores them at the same temperature.
            ep._sink_call(tid, ep.sink.add_generated, tid, list(tokens), list(logprobs), list(versions),
                          engine=engine.name, finish_reason=finish_reason, temperature=s.temperature,
                          top_p=s.top_p)

    async def _generate(self) -> AsyncIterator[TokenDelta]:
        ep, req, tid = self._endpoint, self.request, self.trajectory_id
        s = self._sampling
        assert s.temperature is not None and s.top_p is not None  # resolved() filled them
        base = GenerationRequest(request_id=ep._next_request_id(), prompt_token_ids=req.prompt_token_ids,
                                 max_new_tokens=self._max_new, temperature=s.temperature, top_p=s.top_p,
                                 seed=s.seed, stop_token_ids=s.stop_token_ids)
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        interruptions = 0
        interrupted = False  # the sink was told; told again only after new tokens
        stop_met = req.stop_when() if req.stop_when is not None else None
        while True:
            engine = await ep._running_engine(tid)
            epoch = engine.pauses
            request = base if not tokens else base.continued(tokens, ep._next_request_id())
            seg_tokens: list[int] = []
            seg_logprobs: list[float] = []
            seg_versions: list[int] = []
            finish: FinishReason | None = None
            chunks = engine.generate(request)
            here = 1 if engine is ep._engine else 0  # `generating` and `quiesce` count this engine's alone
            ep._in_engine += here
            ep._running[tid] = (engine, request.request_id)
            try:
                async for chunk in chunks:
                    seg_tokens += chunk.token_ids
                    seg_logprobs += chunk.logprobs
                    seg_versions += chunk.versions
                    if chunk.finish_reason is not None:
                        finish = chunk.finish_reason
                    if chunk.token_ids:
                        yield TokenDelta(chunk.token_ids, chunk.logprobs, chunk.versions)
                    # Every token goes to the matcher (the reply's text is continuous across segments).
                    met = stop_met is not None and bool(chunk.token_ids) and stop_met(chunk.token_ids)
                    if finish is None and met:
                        finish = "stop"  # closing the stream (below) ends the request on the engine
                        break
            except (GeneratorExit, asyncio.CancelledError, Exception):
                # The agent went away mid-turn, or the engine died under it (a stop signal reached its
                # process): keep what was generated, as an interrupted segment, for a continuation.
                ep._in_engine -= here
                ep._running.pop(tid, None)
                await chunks.aclose()  # type: ignore[attr-defined]
                self._record(seg_tokens, seg_logprobs, seg_versions, engine, "abort")
                if seg_tokens or not interrupted:
                    ep._sink_call(tid, ep.sink.interrupt, tid)
                raise
            finally:
                await chunks.aclose()  # type: ignore[attr-defined]
                ep._running.pop(tid, None)
            if finish is None:
                ep._in_engine -= here
                raise RuntimeError(f"engine '{engine.name}' ended request {request.request_id} without a finish reason")
            tokens += seg_tokens
            logprobs += seg_logprobs
            versions += seg_versions
            # Paused, replaced, or routed elsewhere (or back) meanwhile: the turn continues from its prefix.
            paused = engine.paused or engine.pauses != epoch or engine is not ep.engine_for(tid)
            try:
                if finish == "abort" and paused and len(tokens) < self._max_new:
                    self._record(seg_tokens, seg_logprobs, seg_versions, engine, "abort")
                    if seg_tokens or not interrupted:
                        ep._sink_call(tid, ep.sink.interrupt, tid)
                        interrupted = True
                    interruptions += 1
                    continue
                if finish == "abort" and paused:
                    finish = "length"  # paused just as the budget ran out: nothing is left to continue
                self._record(seg_tokens, seg_logprobs, seg_versions, engine, finish)
                if finish == "abort":  # cancelled on the engine (not paused): the turn ends here
                    ep._sink_call(tid, ep.sink.interrupt, tid)
                break
            finally:
                ep._in_engine -= here  # recorded: `quiesce` may count this generation as settled
        self.result = TurnResult(tid, req.prompt_token_ids, tuple(tokens), tuple(logprobs), tuple(versions),
                                 finish, interruptions)
