"""New weights from the broadcast group into a running rollout engine.

A rollout rank waits for the next version without blocking its event loop (`next_version` polls the
header), then `apply_version` pauses the engine, loads the version bucket by bucket as it arrives and
resumes: generation stops only for the transfer and the loads, and the rank never holds more than the
receiver's bucket buffers (``depth`` buckets, two by default) beyond the engine's own weights.

With ``engine.staged_updates`` the version is received first, beside the weights the engine serves, while it
goes on generating with them: into the rank's copy when the rank receives the buckets (`receive_aside`), into a
second copy in the engine's own memory when its processes do (`RolloutEngine.stage_weights`). `apply_version`
then pauses the engine only to load what is already there. Every token still comes from one version: the engine
switches while paused, at one token boundary.

The engine's version moves once, to the publisher's version, when the last bucket is in: the buckets
before it go through the engine's backend hook (`RolloutEngine._load_weights`) because the public
``load_weights`` bumps the version on every call. A version must be newer than the engine's; an older
one is drained (the broadcast is collective) and refused before anything is loaded.

An adapter version (LoRA, `sfhpc.weights.adapter`) is received whole first (it is small), then merged into
the engine's frozen weights (`AdapterMerge`) and loaded a layer group at a time; an engine whose own processes
receive the buckets merges it there.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator

import torch

from sfhpc.engine.base import EngineStateError, RolloutEngine
from sfhpc.weights import adapter
from sfhpc.weights.manifest import WeightManifest
from sfhpc.weights.publisher import IncomingWeights, WeightReceiver

POLL_SECONDS = 0.005  # header polling: short enough to be prompt, long enough not to spin a core
STAGED_POLL_SECONDS = 0.02  # asking an engine whether its staged version is in: a call between its decode steps


async def header_arrived(receiver: WeightReceiver, poll_seconds: float = POLL_SECONDS) -> None:
    """Wait, without blocking the event loop, until the next version's header is here (`next_version` then
    returns at once)."""
    pending = receiver.start()
    while not pending.ready():
        await asyncio.sleep(poll_seconds)


async def next_version(receiver: WeightReceiver, poll_seconds: float = POLL_SECONDS) -> IncomingWeights | None:
    """Wait for the next version's header while the event loop keeps serving; None once the publisher
    has finished."""
    pending = receiver.start()
    while not pending.ready():
        await asyncio.sleep(poll_seconds)
    return pending.result()


@dataclasses.dataclass
class StagedVersion:
    """A version whose buckets are all in the rank's copy (`receive_aside`): views into it, ready to load."""

    version: int
    manifest: WeightManifest
    buckets: list[list[tuple[str, torch.Tensor]]]
    lands_in_engine: bool = False

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def __iter__(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        return iter(self.buckets)

    def drain(self) -> None:
        return None  # received already


async def receive_aside(incoming: IncomingWeights, poll_seconds: float = POLL_SECONDS) -> StagedVersion:
    """Receive every bucket of `incoming` into the rank's copy (a receiver that keeps one) without blocking the
    event loop, so the engine goes on generating meanwhile; a delta is applied to the copy here too. What
    `apply_version` then loads is already in memory: the engine pauses for its loads alone."""
    while not incoming.arrived():
        await asyncio.sleep(poll_seconds)
    return StagedVersion(incoming.version, incoming.manifest, list(incoming))


async def stage_in_engine(engine: RolloutEngine, incoming: IncomingWeights,
                          poll_seconds: float = STAGED_POLL_SECONDS) -> None:
    """Where the engine's own processes receive the buckets: they receive `incoming` into a second copy in their
    memory while the engine goes on generating; returns once every bucket is there (`apply_version` then loads
    it in one pause)."""
    await engine.stage_weights(incoming.manifest, version=incoming.version)
    incoming.landed()
    while not await engine.staged_arrived():
        await asyncio.sleep(poll_seconds)


async def receive_beside(engine: RolloutEngine, incoming: IncomingWeights) -> IncomingWeights | StagedVersion:
    """``engine.staged_updates``: `incoming` received beside the weights `engine` serves while it goes on
    generating with them (into its own second copy where its processes receive the buckets, else into the rank's
    copy); `apply_version` then pauses it only to load the version. An older version than the engine's is left
    as it is (`apply_version` drains and refuses it)."""
    if incoming.version <= engine.version:
        return incoming
    if incoming.lands_in_engine:
        await stage_in_engine(engine, incoming)
        return incoming
    return await receive_aside(incoming)


async def apply_version(engine: RolloutEngine, incoming: IncomingWeights | StagedVersion,
                        merge: adapter.AdapterMerge | None = None) -> int:
    """Pause `engine`, load every bucket of `incoming`, set the engine's version to the publisher's and
    resume (if this call paused it). Returns the new version. An adapter version is merged by `merge` (the
    frozen weights of the folder the engine started from) before it is loaded.

    If a load fails the engine holds a mix of two versions: it stays paused and the error propagates
    (after the rest of the version is drained, so the other ranks of the group are not left waiting; where
    the engine's processes receive the buckets themselves, a failure there ends the run through the fault path).
    """
    if incoming.version <= engine.version:
        if incoming.lands_in_engine:
            await engine.receive_weights(incoming.manifest, version=incoming.version, load=False)
        incoming.drain()
        raise EngineStateError(f"engine '{engine.name}' holds version {engine.version}; the broadcast brought "
                               f"version {incoming.version}, which is not newer")
    was_paused = engine.paused
    try:
        await engine.pause()
        if engine.staged_version == incoming.version:  # in the engine's own memory already (`stage_in_engine`)
            await engine.load_staged()
        elif incoming.lands_in_engine:  # the engine's own processes receive the buckets and load them
            assert isinstance(incoming, IncomingWeights)
            await engine.receive_weights(incoming.manifest, version=incoming.version)
            incoming.landed()
        elif adapter.is_adapter(t.name for t in incoming.manifest.tensors):
            if merge is None:
                raise EngineStateError(f"engine '{engine.name}' received an adapter (LoRA) version but has no "
                                       "model folder to merge it into")
            deltas = adapter.deltas_of((name, t.clone()) for bucket in incoming for name, t in bucket)
            for group in merge.loads(deltas):
                await engine._load_weights(group)
            await engine.load_weights([], version=incoming.version)
        elif incoming.num_buckets == 0:
            await engine.load_weights([], version=incoming.version)
        else:
            for index, bucket in enumerate(incoming):
                if index + 1 < incoming.num_buckets:
                    await engine._load_weights(bucket)
                else:
                    await engine.load_weights(bucket, version=incoming.version)
    except BaseException:
        incoming.drain()
        raise
    if not was_paused:
        await engine.resume()
    return engine.version
