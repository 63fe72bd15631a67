"""The rollout engine interface: what every inference backend offers to the agent endpoint.

The shape follows what vLLM's ``AsyncLLM`` can do for RL, so the vLLM backend is a thin adapter:

- ``generate`` streams new tokens with their logprobs and the weight version that produced each one,
  and ends with a finish reason: ``stop`` (a stop token), ``length`` (the token budget or the context
  is used up) or ``abort``;
- ``pause`` ends every in-flight generation with ``abort``; the last chunk holds the final tokens, so
  the caller has the partial output (vLLM: ``pause_generation(mode="abort")``);
- ``load_weights`` is allowed only while paused and bumps ``version`` (vLLM: ``collective_rpc``);
- ``resume`` lets generation run again (vLLM: ``resume_generation``);
- ``abort`` ends one request the same way (vLLM: ``abort(request_id)``).

A paused generation is continued by resubmitting ``prompt + partial`` with the remaining budget
(`GenerationRequest.continued`), on this engine after ``resume`` or on any other engine: that is
partial rollout. The engine owns the pause state; callers read it through ``paused``, ``pauses`` and
``wait_resumed`` to tell a pause from a cancellation.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from sfhpc.errors import SfhpcError

if TYPE_CHECKING:
    from sfhpc.weights.group import WeightGroup
    from sfhpc.weights.manifest import WeightManifest

FinishReason = Literal["stop", "length", "abort"]


class EngineStateError(SfhpcError):
    """An engine call made in a state that does not allow it (e.g. loading weights while generating)."""


class EngineDied(EngineStateError):
    """The engine's processes are gone (killed, out of memory, a device error): the call could not reach them.
    The engine has been marked dead (`RolloutEngine.died`), which is what its rank's restart waits for."""


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One generation: a prompt of token ids and how to sample its continuation.

    ``temperature == 0`` is greedy. With a ``seed`` the sampling is reproducible; engines that can, make
    the draw at each position depend only on the seed and the tokens before it, so a resubmitted
    continuation samples what the uninterrupted request would have (given the same weights).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("a generation needs at least one prompt token")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, found {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be 0 or more, found {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], found {self.top_p}")

    def continued(self, generated: Sequence[int], request_id: str) -> GenerationRequest:
        """The request that continues this one after `generated` tokens: longer prompt, smaller budget."""
        return dataclasses.replace(self, request_id=request_id,
                                   prompt_token_ids=self.prompt_token_ids + tuple(generated),
                                   max_new_tokens=self.max_new_tokens - len(generated))


@dataclasses.dataclass(frozen=True)
class GenerationChunk:
    """New tokens of one request since the previous chunk (a delta, not cumulative).

    ``versions[i]`` is the weight version that produced ``token_ids[i]``. The last chunk of a request has
    a ``finish_reason`` and may hold no tokens.
    """

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: FinishReason | None = None

    def __post_init__(self) -> None:
        if not len(self.token_ids) == len(self.logprobs) == len(self.versions):
            raise ValueError("a chunk needs one logprob and one version per token")


class RolloutEngine(abc.ABC):
    """An inference backend. All methods run on the event loop that calls ``generate``.

    Subclasses implement `generate`, `abort`, `_pause_generation`, `_resume_generation`, `_load_weights`
    and `max_model_len`; the pause bookkeeping lives here so that every backend reports it alike.
    """

    def __init__(self, name: str, *, version: int = 0) -> None:
        self.name = name
        self._version = version
        self._paused = False
        self._pauses = 0
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._sleeping = False
        self._dead = asyncio.Event()
        self._staged: int | None = None  # a version received beside the weights, not loaded yet (`stage_weights`)

    # -- what a backend implements ---------------------------------------------------------------
    @property
    @abc.abstractmethod
    def max_model_len(self) -> int:
        """Most tokens (prompt + generated) one sequence may hold."""

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream the continuation of ``request.prompt_token_ids``; the last chunk has a finish reason.

        Called while paused, it waits for ``resume`` before it starts. Closing the iterator early aborts
        the request.
        """

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """End one request with ``abort`` (its stream yields the last tokens first); unknown ids are ignored."""

    @abc.abstractmethod
    async def _pause_generation(self) -> None:
        """End every in-flight request with ``abort`` and start no new one."""

    @abc.abstractmethod
    async def _resume_generation(self) -> None:
        """Start generating again."""

    @abc.abstractmethod
    async def _load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Replace the model weights (called only while paused)."""

    # -- what a backend may implement: receiving weights in its own processes ---------------------------
    @property
    def weight_group_members(self) -> int:
        """How many of the engine's processes join a weight group to receive weights themselves (vLLM: its
        tensor-parallel workers); 0: the rank receives them and calls `load_weights`."""
        return 0

    async def join_weight_group(self, group: WeightGroup, first_member: int) -> None:
        """Have the engine's processes join `group` as members ``first_member, first_member + 1, ...``;
        returns once every member of the group has joined."""
        raise EngineStateError(f"engine '{self.name}' cannot receive weights in its own processes")

    async def _receive_weights(self, manifest: WeightManifest, *, load: bool) -> None:
        """Receive every bucket of `manifest` from the joined group and load it (or only receive it)."""
        raise EngineStateError(f"engine '{self.name}' never joined a weight group")

    async def _stage_weights(self, manifest: WeightManifest) -> None:
        """Start receiving every bucket of `manifest` from the joined group into a second copy of the weights in
        the engine's own memory, and return at once (the engine goes on generating)."""
        raise EngineStateError(f"engine '{self.name}' cannot stage weights in its own processes")

    async def _staged_arrived(self) -> bool:
        """True once every bucket of the staged version is in the engine's second copy."""
        raise EngineStateError(f"engine '{self.name}' cannot stage weights in its own processes")

    async def _load_staged(self) -> None:
        """Load the staged version from the engine's second copy (called only while paused)."""
        raise EngineStateError(f"engine '{self.name}' cannot stage weights in its own processes")

    def shutdown(self) -> None:  # noqa: B027 (a hook engines without processes leave empty)
        """Stop the engine's own processes, if it has any (call from the engine's event loop)."""

    def kill_processes(self) -> int:
        """Kill the engine's own processes outright (fault injection's ``engine=kill``); returns how many. An
        engine without processes of its own has none to kill."""
        return 0

    async def _sleep(self) -> None:  # noqa: B027 (a hook most engines leave empty)
        """Give the engine's device memory back (called paused); engines without such memory do nothing."""

    async def _wake_up(self) -> None:  # noqa: B027
        """Take the memory `_sleep` gave back, the weights as they were."""

    # -- the interface -------------------------------------------------------------------------
    @property
    def sleeping(self) -> bool:
        return self._sleeping

    async def sleep(self) -> None:
        """Pause (if generating) and give the device memory back to the trainer that shares the GPU; the
        next `wake_up` restores it, the weights unchanged."""
        if self._sleeping:
            return
        await self.pause()
        await self._sleep()
        self._sleeping = True

    async def wake_up(self) -> None:
        """Take the memory back (still paused: the caller resumes)."""
        if self._sleeping:
            await self._wake_up()
            self._sleeping = False

    @property
    def version(self) -> int:
        """Version of the weights that generate now."""
        return self._version

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def pauses(self) -> int:
        """How many times the engine was paused. A request whose stream ends with ``abort`` while this
        number moved was stopped by a pause (and should be continued), not cancelled."""
        return self._pauses

    async def wait_resumed(self) -> None:
        await self._resumed.wait()

    async def wait_dead(self) -> None:
        """Until the engine's processes are gone (`died`): it generates no more, and stays paused."""
        await self._dead.wait()

    def died(self) -> None:
        """A backend found its processes gone. The engine counts as paused from now on, so that the streams it
        ends with ``abort`` are continued (on an engine that replaces it) rather than taken as cancelled."""
        if not self._paused:
            self._paused = True
            self._pauses += 1
            self._resumed.clear()
        self._dead.set()

    async def pause(self) -> None:
        """Stop generating: in-flight streams end with ``abort`` holding their partial tokens."""
        if self._paused:
            return
        # State first: a stream that sees its abort must already find the engine paused.
        self._paused = True
        self._pauses += 1
        self._resumed.clear()
        await self._pause_generation()

    async def resume(self) -> None:
        if not self._paused:
            return
        await self._resume_generation()
        self._paused = False
        self._resumed.set()

    async def load_weights(self, weights: Iterable[tuple[str, Any]], *, version: int | None = None) -> int:
        """Load named weights (in the engine's naming) and return the new version.

        ``version`` defaults to the current one plus one; a publisher passes its own step number.
        """
        if not self._paused:
            raise EngineStateError(f"engine '{self.name}' is generating: pause() it before load_weights()")
        new_version = self._version + 1 if version is None else version
        if new_version <= self._version:
            raise EngineStateError(f"engine '{self.name}' holds version {self._version}; a weight load must "
                                   f"bring a higher one, found {new_version}")
        await self._load_weights(weights)
        self._version = new_version
        return new_version

    @property
    def staged_version(self) -> int | None:
        """The version the engine's processes are receiving or hold beside the weights that generate
        (`stage_weights`), not loaded yet; None when there is none."""
        return self._staged

    async def stage_weights(self, manifest: WeightManifest, *, version: int) -> None:
        """Start receiving `version` from the weight group the engine joined into a second copy of the weights
        in its own memory (``engine.staged_updates``) while it goes on generating with the weights it holds;
        `staged_arrived` says when all of it is in, and `load_staged` (paused) makes it the weights that
        generate. Every token still comes from one version."""
        if version <= self._version:
            raise EngineStateError(f"engine '{self.name}' holds version {self._version}; a staged version must be "
                                   f"newer, found {version}")
        if self._staged is not None:
            raise EngineStateError(f"engine '{self.name}' has version {self._staged} staged and not loaded yet")
        await self._stage_weights(manifest)
        self._staged = version

    async def staged_arrived(self) -> bool:
        """True once every bucket of the staged version is in (a call between the engine's decode steps)."""
        if self._staged is None:
            raise EngineStateError(f"engine '{self.name}' has no staged version")
        return await self._staged_arrived()

    async def load_staged(self) -> int:
        """Make the staged version the one that generates (paused only); returns it."""
        if not self._paused:
            raise EngineStateError(f"engine '{self.name}' is generating: pause() it before load_staged()")
        if self._staged is None:
            raise EngineStateError(f"engine '{self.name}' has no staged version")
        await self._load_staged()
        self._version, self._staged = self._staged, None
        return self._version

    async def receive_weights(self, manifest: WeightManifest, *, version: int, load: bool = True) -> int:
        """Receive a version from the weight group the engine joined (`join_weight_group`) and, with `load`,
        load it as `version` (paused only, and newer only, as `load_weights`); without, only take its
        buckets off the wire (the broadcast is collective) and keep the weights. Returns the engine's version."""
        if load:
            if not self._paused:
                raise EngineStateError(f"engine '{self.name}' is generating: pause() it before receive_weights()")
            if version <= self._version:
                raise EngineStateError(f"engine '{self.name}' holds version {self._version}; a weight load must "
                                       f"bring a higher one, found {version}")
        await self._receive_weights(manifest, load=load)
        if load:
            self._version = version
        return self._version
