"""New weights from the broadcast group into a running rollout engine.

A rollout rank waits for the next version without blocking its event loop (`next_version` polls the
header), then `apply_version` pauses the engine, loads the version bucket by bucket as it arrives and
resumes: generation stops only for the transfer and the loads, and the rank never holds more than the
receiver's bucket buffers (``depth`` buckets, two by default) beyond the engine's own weights.

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

from sfhpc.engine.base import EngineStateError, RolloutEngine
from sfhpc.weights import adapter
from sfhpc.weights.publisher import IncomingWeights, WeightReceiver

POLL_SECONDS = 0.005  # header polling: short enough to be prompt, long enough not to spin a core


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


async def apply_version(engine: RolloutEngine, incoming: IncomingWeights,
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
        if incoming.lands_in_engine:  # the engine's own processes receive the buckets and load them
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
