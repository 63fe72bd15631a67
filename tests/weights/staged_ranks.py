"""Rank program of the staged-update test: `mpiexec -n 2 python -m tests.weights.staged_ranks OUT LINK_S`.

Rank 0 publishes two versions (1-2, then 3-4) of a set of tensors in small buckets over MPI, once for a receiver
that loads each version as it arrives (``paused``) and once for one that stages it (``staged``). Rank 1 runs the
test engine, which generates without a break (one request after another), on a link paced to `LINK_S` s a version
(`sfhpc.weights.paced.PacedLink`, the timing scale's network), and records per version: how long the version
took to come in and how long the engine was paused, every token's time and version, and a SHA-256 of what its
copy holds against what rank 0 sent.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from tests.weights.broadcast_ranks import BUCKET_BYTES, digest, weights

MODES = ("paused", "staged")


def polled_barrier(comm: Any) -> None:
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.01)


def publisher_rank(comm: Any, links: dict[str, Any]) -> dict[str, Any]:
    from sfhpc.weights import WeightPublisher, connect

    sent: dict[str, Any] = {}
    for index, (mode, link) in enumerate(links.items()):
        publisher = WeightPublisher(connect(link, "mpi"), bucket_bytes=BUCKET_BYTES)
        versions = (2 * index + 1, 2 * index + 2)
        for version in versions:
            polled_barrier(comm)  # the receiver generates and listens
            publisher.publish(iter(weights(version)), version)
        publisher.finish()
        sent[mode] = {str(v): {n: digest(t) for n, t in weights(v)} for v in versions}
    return sent


async def engine_rank(comm: Any, links: dict[str, Any], link_s: float) -> dict[str, Any]:
    from sfhpc.engine.base import GenerationRequest
    from sfhpc.engine.scripted import ScriptedEngine
    from sfhpc.engine.weight_sync import apply_version, next_version, receive_beside
    from sfhpc.weights import WeightReceiver, connect
    from sfhpc.weights.paced import PacedLink

    engine = ScriptedEngine(seed=0, token_delay=0.005)
    tokens: list[tuple[float, int]] = []  # (time, version) of every token generated
    running = True

    async def generate_on() -> None:
        calls = 0
        while running:
            calls += 1
            async for chunk in engine.generate(GenerationRequest(f"r{calls}", (1, 2, 3), 40, seed=calls)):
                tokens.extend((time.monotonic(), v) for v in chunk.versions)

    async def barrier() -> None:
        request = comm.Ibarrier()
        while not request.Test():
            await asyncio.sleep(0.01)

    generating = asyncio.create_task(generate_on())
    record: dict[str, Any] = {}
    for mode, link in links.items():
        transport = PacedLink(await asyncio.to_thread(connect, link, "mpi"), link_s)
        receiver = WeightReceiver(transport, keep_copy=True)
        updates = []
        for _ in (1, 2):
            await barrier()
            incoming = await next_version(receiver)
            assert incoming is not None
            started = time.monotonic()
            loading: Any = await receive_beside(engine, incoming) if mode == "staged" else incoming
            paused = time.monotonic()
            await apply_version(engine, loading)
            resumed = time.monotonic()
            held = receiver.held_weights()
            assert held is not None
            updates.append({"version": incoming.version, "started": started, "paused": paused, "resumed": resumed,
                            "held": {str(held[0]): {n: digest(t) for n, t in held[1]}}})
        assert await next_version(receiver) is None
        record[mode] = updates
    running = False
    await generating
    record["tokens"] = tokens
    return record


def main() -> int:
    from mpi4py import MPI

    out, link_s = Path(sys.argv[1]), float(sys.argv[2])
    world = MPI.COMM_WORLD
    comm = world.Split(0, world.Get_rank())  # the test's own synchronisation
    links = {mode: comm.Dup() for mode in MODES}  # one weight-broadcast group per mode
    record = publisher_rank(comm, links) if comm.Get_rank() == 0 else asyncio.run(engine_rank(comm, links, link_s))
    (out / f"rank{comm.Get_rank()}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
