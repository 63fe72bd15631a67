"""The weight publisher (trainer side) and receiver (engine side) of one broadcast group.

Per version: the publisher plans the buckets, shares the manifest (so the version number travels with
the layout), then broadcasts each bucket. A receiver gets the manifest from `receive` and then, bucket
by bucket, ``(name, tensor)`` lists that are views into the received bytes, ready for the engine's
``load_weights`` before the next bucket comes.

Buffers. By default a receiver reuses one buffer for every bucket and version, so a bucket's tensors
are valid only until the next bucket is received: the engine's load copies them into its parameters,
which is all it needs. A fresh allocation per bucket would let the views live on, but first-touch page
faults then cost more than the broadcast itself (measured: ~3x slower on a 2-core machine); ask for
that with ``WeightReceiver(..., reuse_buffers=False)``.

    # trainer rank 0                                  # every engine rank
    publisher = WeightPublisher(MPITransport(comm))   receiver = WeightReceiver(MPITransport(comm))
    publisher.publish(trainer.named_weights(torch.bfloat16),
                      version=trainer.policy_version)  incoming = receiver.receive()   # None: finished
                                                       for named in incoming:          # one bucket
                                                           engine_load(named, incoming.version)
    publisher.finish()                                 # at the end of the run

Every bucket must be consumed on every receiver (the broadcasts are collective); `IncomingWeights.drain`
does so for a receiver that has nothing to load.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator

import torch

from sfhpc.weights.manifest import WeightManifest, plan_buckets, unpack
from sfhpc.weights.transport import WeightTransport

DEFAULT_BUCKET_BYTES = 32 << 20


@dataclasses.dataclass(frozen=True)
class PublishStats:
    version: int
    tensors: int
    bytes: int
    buckets: int
    seconds: float  # whole publish, as the source saw it: plan, manifest and broadcasts

    @property
    def bandwidth(self) -> float:
        """Bytes per second of the whole publish, as seen by the source."""
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


class WeightPublisher:
    """The sending side; lives on the transport's source rank."""

    def __init__(self, transport: WeightTransport, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if not transport.is_source:
            raise ValueError("a WeightPublisher lives on the transport's source rank; use WeightReceiver elsewhere")
        self.transport = transport
        self.bucket_bytes = bucket_bytes

    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> PublishStats:
        """Broadcast one version. `named` may be a generator; its tensors are read once, in order, and must
        stay unchanged until this returns."""
        start = time.perf_counter()
        items = list(named)
        manifest = plan_buckets(items, version, self.bucket_bytes)
        self.transport.share_manifest(manifest)
        index = 0
        for bucket in range(manifest.num_buckets):
            metas = manifest.bucket(bucket)
            self.transport.broadcast_bucket(metas, [t for _, t in items[index:index + len(metas)]], None)
            index += len(metas)
        return PublishStats(version=version, tensors=len(items), bytes=manifest.total_bytes,
                            buckets=manifest.num_buckets, seconds=time.perf_counter() - start)

    def finish(self) -> None:
        """Tell every receiver there are no more versions (their `receive` returns None)."""
        self.transport.share_manifest(None)


class IncomingWeights:
    """One version on its way in: the manifest now, the buckets as they are iterated."""

    def __init__(self, receiver: WeightReceiver, manifest: WeightManifest) -> None:
        self._receiver = receiver
        self.manifest = manifest
        self._next = 0

    @property
    def version(self) -> int:
        return self.manifest.version

    def __iter__(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Receive the buckets in order; each is ``[(name, tensor), ...]`` of views into the received bytes."""
        while self._next < self.manifest.num_buckets:
            bucket, metas = self._next, self.manifest.bucket(self._next)
            buffer = self._receiver._buffer_for(self.manifest.bucket_sizes[bucket])
            self._receiver.transport.broadcast_bucket(metas, None, buffer)
            self._next += 1
            yield unpack(buffer, metas)

    def drain(self) -> None:
        """Receive and drop the remaining buckets (collective: the other ranks wait for them)."""
        for _ in self:
            pass


class WeightReceiver:
    """The receiving side; lives on every other rank of the transport."""

    def __init__(self, transport: WeightTransport, *, reuse_buffers: bool = True) -> None:
        if transport.is_source:
            raise ValueError("the transport's source rank publishes; use WeightPublisher there")
        self.transport = transport
        self.reuse_buffers = reuse_buffers
        self._buffer: torch.Tensor | None = None

    def receive(self) -> IncomingWeights | None:
        """Wait for the next version's manifest; None once the publisher has called `finish`.

        The previous version's buckets must all have been consumed (`IncomingWeights.drain`)."""
        manifest = self.transport.share_manifest(None)
        return None if manifest is None else IncomingWeights(self, manifest)

    def _buffer_for(self, nbytes: int) -> torch.Tensor:
        if not self.reuse_buffers:
            return self.transport.allocate(nbytes)
        if self._buffer is None or len(self._buffer) < nbytes:
            self._buffer = self.transport.allocate(nbytes)
        return self._buffer[:nbytes]
