"""The weight publisher (trainer side) and receiver (engine side) of one broadcast group.

Per version the publisher sends a 32-byte header (kind, version, layout hash, messages), the manifest
only when the layout changed since the previous version, then the messages of every bucket. It keeps,
per layout, the bucket plan and a persistent staging buffer: large tensors already in the wire dtype go
straight from their own memory, the rest are cast or copied into staging in one pass (float32 master
weights become bf16 there, with no intermediate copy) and sent run by run while the next run is packed.

A receiver turns a header into `IncomingWeights` and then, bucket by bucket, ``(name, tensor)`` lists
that are views into its bucket buffers, ready for the engine's ``load_weights``. It holds `depth`
bucket buffers (2 by default) and receives the next bucket into one while the engine loads the current
one from another: a rollout rank never holds more than ``depth`` buckets beyond its engine. A bucket's
views are valid until the next bucket is requested; ``WeightReceiver(..., reuse_buffers=False)`` gives
every bucket a fresh buffer whose views live on (first-touch page faults then cost more than the
broadcast itself on small machines).

    # trainer rank 0                                  # every engine rank
    publisher = WeightPublisher(MPITransport(comm))   receiver = WeightReceiver(MPITransport(comm))
    publisher.publish(trainer.named_weights(),
                      version=trainer.policy_version,  incoming = receiver.receive()   # None: finished
                      dtype=torch.bfloat16)            for named in incoming:          # one bucket
                                                           engine_load(named, incoming.version)
    publisher.finish()                                 # at the end of the run

Every bucket must be consumed on every receiver (the broadcasts are collective); `IncomingWeights.drain`
does so for a receiver that has nothing to load. `WeightReceiver.start` waits for a header without
blocking (poll `PendingVersion.ready`), for ranks that generate while they wait.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator

import torch

from sfhpc.weights.errors import WeightStreamError
from sfhpc.weights.manifest import (
    ALIGN,
    DEFAULT_CHUNK_BYTES,
    Message,
    WeightManifest,
    module_group,
    plan_buckets,
    typed_view,
    unpack,
)
from sfhpc.weights.transport import Transfer, WeightTransport

DEFAULT_BUCKET_BYTES = 32 << 20
# Tensors from this size on are sent from their own memory: below it, one more message costs more than
# copying the bytes into a staged run (measured: ~7 us per message, ~8 GB/s copies).
DEFAULT_DIRECT_BYTES = 64 << 10

HEADER_WORDS = 4  # kind, version, layout hash, number of messages
_FINISH, _SAME_LAYOUT, _NEW_LAYOUT = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class PublishStats:
    version: int
    tensors: int
    bytes: int  # bucket bytes, padding included
    buckets: int
    messages: int
    seconds: float  # whole publish as the source saw it: header, manifest if sent, packing, transfers
    pack_seconds: float  # of which the source spent casting/copying tensors into staging
    manifest_sent: bool

    @property
    def bandwidth(self) -> float:
        """Bytes per second of the whole publish, as seen by the source."""
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


@dataclasses.dataclass(frozen=True)
class _Step:
    """One message as the source sends it: from a direct tensor, or from staging after packing."""

    message: Message
    source: int | None  # index of the direct tensor holding the bytes; None: staged
    source_offset: int  # byte offset of the message inside that tensor
    pack: tuple[int, ...]  # staged tensors to cast/copy into staging before the message goes
    staged: object  # the transport's handle to the message's slice of staging (None: direct)


class _SourcePlan:
    """What the source keeps per layout: the manifest, the steps, staging and the typed views into it."""

    def __init__(self, key: object, manifest: WeightManifest, direct: list[bool], transport: WeightTransport) -> None:
        self.key = key
        self.manifest = manifest
        metas = manifest.tensors
        direct_starts: dict[int, list[int]] = {}
        direct_at: dict[tuple[int, int], int] = {}
        staged: dict[int, list[int]] = {}
        for i, meta in enumerate(metas):
            if not meta.nbytes:
                continue
            if direct[i]:
                direct_starts.setdefault(meta.bucket, []).append(meta.offset)
                direct_at[meta.bucket, meta.offset] = i
            else:
                staged.setdefault(meta.bucket, []).append(i)
        # Staging holds the staged messages in order, each at an offset congruent to its bucket offset
        # modulo ALIGN (so every tensor view in it is aligned); the pieces of one run stay adjacent, so a
        # tensor spanning several pieces is contiguous in staging too.
        owners = [_inside(direct_starts, direct_at, metas, m) for m in manifest.messages]
        stage_offsets: list[int] = []
        stage_end = 0
        for m, owner in zip(manifest.messages, owners):
            if owner is None:
                stage_end += (m.offset - stage_end) % ALIGN
                stage_offsets.append(stage_end)
                stage_end += m.nbytes
            else:
                stage_offsets.append(-1)
        self.staging = transport.allocate(stage_end) if stage_end else None
        self.pack_views: dict[int, torch.Tensor] = {}
        steps = []
        next_staged = dict.fromkeys(staged, 0)
        for m, owner, stage_at in zip(manifest.messages, owners, stage_offsets):
            if owner is not None:
                steps.append(_Step(m, owner, m.offset - metas[owner].offset, (), None))
                continue
            assert self.staging is not None
            pack = []
            queue = staged.get(m.bucket, [])
            while next_staged.get(m.bucket, 0) < len(queue) and metas[queue[next_staged[m.bucket]]].offset < m.end:
                i = queue[next_staged[m.bucket]]
                self.pack_views[i] = typed_view(self.staging, metas[i], base=m.offset - stage_at)
                pack.append(i)
                next_staged[m.bucket] += 1
            steps.append(_Step(m, None, 0, tuple(pack), transport.wire(self.staging, stage_at, m.nbytes)))
        self.steps = tuple(steps)


def _inside(starts: dict[int, list[int]], at: dict[tuple[int, int], int], metas: tuple, m: Message) -> int | None:
    """Index of the direct tensor message `m` is a piece of, or None."""
    offsets = starts.get(m.bucket)
    if not offsets:
        return None
    j = bisect.bisect_right(offsets, m.offset) - 1
    if j < 0:
        return None
    i = at[m.bucket, offsets[j]]
    return i if m.offset < metas[i].offset + metas[i].nbytes else None


class WeightPublisher:
    """The sending side; lives on the transport's source rank."""

    def __init__(self, transport: WeightTransport, bucket_bytes: int = DEFAULT_BUCKET_BYTES, *,
                 direct_bytes: int = DEFAULT_DIRECT_BYTES, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 group: Callable[[str], str] | None = module_group) -> None:
        if not transport.is_source:
            raise ValueError("a WeightPublisher lives on the transport's source rank; use WeightReceiver elsewhere")
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self.direct_bytes = direct_bytes
        self.chunk_bytes = chunk_bytes
        self.group = group
        self._plan: _SourcePlan | None = None
        self._header = torch.zeros(HEADER_WORDS, dtype=torch.int64)

    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int, *,
                dtype: torch.dtype | None = None) -> PublishStats:
        """Broadcast one version; returns when every message has left this rank's memory.

        `named` may be a generator; its tensors are read once, in order, and must stay unchanged until this
        returns. With `dtype` (e.g. ``torch.bfloat16`` from float32 master weights) tensors are cast into
        staging on the way; tensors already in the wire dtype may be sent from where they lie.
        """
        start = time.perf_counter()
        items = [(name, tensor.detach()) for name, tensor in named]
        direct = [self._is_direct(t, dtype) for _, t in items]
        key = (dtype, tuple((n, t.shape, t.dtype, d) for (n, t), d in zip(items, direct)))
        plan = self._plan
        new_layout = plan is None or plan.key != key
        if new_layout:
            manifest = plan_buckets(items, version, self.bucket_bytes, dtype=dtype, direct=direct,
                                    chunk_bytes=self.chunk_bytes, group=self.group)
            plan = self._plan = _SourcePlan(key, manifest, direct, self.transport)
        assert plan is not None
        manifest = plan.manifest
        self._header.copy_(torch.tensor([_NEW_LAYOUT if new_layout else _SAME_LAYOUT, version, manifest.layout,
                                         len(manifest.messages)]))
        # The header's completion is waited for with the rest (the header buffer is not touched before).
        transfers: list[Transfer] = [self.transport.post([self.transport.wire(self._header)])]
        if new_layout:
            self.transport.share_manifest(dataclasses.replace(manifest, version=version))

        tensors = [t for _, t in items]
        wire = self.transport.wire
        ready: list[object] = []  # direct messages not yet posted
        pack_seconds = 0.0
        for step in plan.steps:
            if step.source is not None:
                ready.append(wire(tensors[step.source], step.source_offset, step.message.nbytes))
                continue
            if ready:
                transfers.append(self.transport.post(ready))
                ready = []
            t0 = time.perf_counter()
            for i in step.pack:
                plan.pack_views[i].copy_(tensors[i])  # cast and pack in one pass
            pack_seconds += time.perf_counter() - t0
            # Posting is enough for receivers to start pulling a run while the next one is packed; a
            # progress call here (MPI_Testall) cost more than it saved (~0.15 ms each on a loaded 2-core box).
            transfers.append(self.transport.post([step.staged]))
        if ready:
            transfers.append(self.transport.post(ready))
        self.transport.wait_all(transfers)
        return PublishStats(version=version, tensors=len(items), bytes=manifest.total_bytes,
                            buckets=manifest.num_buckets, messages=len(manifest.messages),
                            seconds=time.perf_counter() - start, pack_seconds=pack_seconds,
                            manifest_sent=new_layout)

    def finish(self) -> None:
        """Tell every receiver there are no more versions (their `receive` returns None)."""
        self._header.copy_(torch.tensor([_FINISH, 0, 0, 0]))
        self.transport.post([self.transport.wire(self._header)]).wait()

    def _is_direct(self, tensor: torch.Tensor, dtype: torch.dtype | None) -> bool:
        return (tensor.device.type == "cpu" and (dtype is None or tensor.dtype == dtype)
                and tensor.numel() * tensor.element_size() >= self.direct_bytes and tensor.is_contiguous())


class _ReceiverLayout:
    """What a receiver keeps per layout: the manifest and, when buffers are reused, the bucket slots with
    their message and tensor views (built once, reused by every version)."""

    def __init__(self, manifest: WeightManifest, receiver: WeightReceiver,
                 previous: _ReceiverLayout | None) -> None:
        self.manifest = manifest
        self._receiver = receiver
        self._cache: dict[int, tuple[list[object], list[tuple[str, torch.Tensor]]]] = {}
        self._slots: list[torch.Tensor] = []
        if receiver.reuse_buffers:
            largest = max(manifest.bucket_sizes, default=0)
            depth = min(receiver.depth, manifest.num_buckets)
            old = previous._slots if previous is not None else []
            self._slots = [old[s] if s < len(old) and len(old[s]) >= largest else receiver.transport.allocate(largest)
                           for s in range(depth)]

    def bucket(self, index: int) -> tuple[list[object], list[tuple[str, torch.Tensor]]]:
        """The message buffers to receive bucket `index` into, and the tensor views over them."""
        cached = self._cache.get(index)
        if cached is not None:
            return cached
        if self._slots:
            buffer = self._slots[index % len(self._slots)]
        else:
            buffer = self._receiver.transport.allocate(self.manifest.bucket_sizes[index])
        wire = self._receiver.transport.wire
        messages = [wire(buffer, m.offset, m.nbytes) for m in self.manifest.bucket_messages(index)]
        views = (messages, unpack(buffer, self.manifest.bucket(index)))
        if self._slots:
            self._cache[index] = views
        return views


class IncomingWeights:
    """One version on its way in: the layout now, the buckets as they are iterated."""

    def __init__(self, receiver: WeightReceiver, layout: _ReceiverLayout, version: int) -> None:
        self._receiver = receiver
        self._layout = layout
        self.version = version
        self._next = 0
        self._posted: dict[int, tuple[Transfer, list[tuple[str, torch.Tensor]]]] = {}

    @property
    def manifest(self) -> WeightManifest:
        return dataclasses.replace(self._layout.manifest, version=self.version)

    @property
    def num_buckets(self) -> int:
        return self._layout.manifest.num_buckets

    @property
    def done(self) -> bool:
        return self._next >= self.num_buckets

    def __iter__(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Receive the buckets in order; each is ``[(name, tensor), ...]`` of views into a bucket buffer,
        valid until the next bucket is requested. Up to ``depth - 1`` following buckets are already on
        their way while the caller works on one."""
        ahead = self._receiver.depth - 1
        while not self.done:
            index = self._next
            for k in range(index, min(index + ahead, self.num_buckets - 1) + 1):
                self._post(k)
            transfer, views = self._posted.pop(index)
            transfer.wait()
            self._next = index + 1
            yield views

    def drain(self) -> None:
        """Receive and drop the remaining buckets (collective: the other ranks wait for them)."""
        for _ in self:
            pass

    def _post(self, index: int) -> None:
        if index not in self._posted:
            messages, views = self._layout.bucket(index)
            self._posted[index] = (self._receiver.transport.post(messages), views)


class PendingVersion:
    """A header on its way: `ready` polls without blocking, `result` waits and returns the version."""

    def __init__(self, receiver: WeightReceiver, header: torch.Tensor, transfer: Transfer) -> None:
        self._receiver = receiver
        self._header = header
        self._transfer = transfer
        self._result: IncomingWeights | None = None
        self._resolved = False

    def ready(self) -> bool:
        return self._resolved or self._transfer.test()

    def result(self) -> IncomingWeights | None:
        """The next version (its manifest read if the layout changed), or None once the publisher finished."""
        if not self._resolved:
            self._transfer.wait()
            self._result = self._receiver._accept(self._header.tolist())
            self._resolved = True
        return self._result


class WeightReceiver:
    """The receiving side; lives on every other rank of the transport."""

    def __init__(self, transport: WeightTransport, *, reuse_buffers: bool = True, depth: int = 2) -> None:
        if transport.is_source:
            raise ValueError("the transport's source rank publishes; use WeightPublisher there")
        if depth < 1:
            raise ValueError(f"depth must be at least 1 bucket buffer, found {depth}")
        self.transport = transport
        self.reuse_buffers = reuse_buffers
        self.depth = depth
        self._layout: _ReceiverLayout | None = None
        self._current: IncomingWeights | None = None
        self._pending: PendingVersion | None = None

    def start(self) -> PendingVersion:
        """Begin waiting for the next header (non-blocking); the same object until its result is taken."""
        if self._pending is not None:
            return self._pending
        if self._current is not None and not self._current.done:
            raise WeightStreamError(f"version {self._current.version} still has buckets on the wire: "
                                    "iterate or drain() it before receiving the next version")
        header = torch.zeros(HEADER_WORDS, dtype=torch.int64)
        self._pending = PendingVersion(self, header, self.transport.post([self.transport.wire(header)]))
        return self._pending

    def receive(self) -> IncomingWeights | None:
        """Wait for the next version; None once the publisher has called `finish`.

        The previous version's buckets must all have been consumed (`IncomingWeights.drain`)."""
        return self.start().result()

    def _accept(self, header: list[int]) -> IncomingWeights | None:
        self._pending = None
        kind, version, layout, messages = header
        if kind == _FINISH:
            self._current = None
            return None
        if kind == _NEW_LAYOUT:
            manifest = self.transport.share_manifest(None)
            if manifest is None or manifest.layout != layout:
                raise WeightStreamError("the manifest that followed a header does not match its layout hash")
            self._layout = _ReceiverLayout(manifest, self, self._layout)
        elif kind != _SAME_LAYOUT:
            raise WeightStreamError(f"unknown weight header kind {kind}: publisher and receiver disagree")
        if self._layout is None or self._layout.manifest.layout != layout or \
                len(self._layout.manifest.messages) != messages:
            raise WeightStreamError(f"version {version} announces a layout this receiver never got a manifest for")
        self._current = IncomingWeights(self, self._layout, version)
        return self._current
