"""The weight publisher (trainer side) and receiver (engine side) of one broadcast group.

A version is published in two phases. **Stage**: the publisher casts or copies every tensor into a
persistent staging buffer that holds the buckets back to back (float32 master weights become bf16
there in one pass). Receivers take no part, so engines keep generating with their current weights for
as long as this takes. **Send**: a 32-byte header (kind, version, layout hash, messages), the manifest
when the layout changed since the previous version, then one message per bucket straight from staging.
Staging is memory the transport allocated for itself (huge pages over MPI), so the send moves at the
speed of a plain broadcast of the same bytes; an engine is paused from the header to its last bucket,
i.e. for the send and its own loads, never for the cast.

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

`publish` is `stage` then `send`; a trainer may call them apart (stage as soon as the optimizer step is
done, send when the controller asks). The source holds one copy of the weights in the wire dtype.

Every bucket must be consumed on every receiver (the broadcasts are collective); `IncomingWeights.drain`
does so for a receiver that has nothing to load. `WeightReceiver.start` waits for a header without
blocking (poll `PendingVersion.ready`), for ranks that generate while they wait.

With ``WeightPublisher(delta=True)`` and receivers that keep a copy (``keep_copy=True``), a version whose
layout they hold is sent as what changed (`sfhpc.weights.delta`): while staging, each bucket is compared with
the version staging held, and the header is followed by a table (per bucket: encoding, bytes, checksum, over
the header's channel) and only the buckets' encodings. Receivers apply each delta to their copy, check the
checksum and hand only the buckets that changed to their engine. A new layout, and a version staged over one
the receivers never got, go whole.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from sfhpc.weights import delta
from sfhpc.weights.errors import WeightStreamError
from sfhpc.weights.manifest import MAX_MESSAGE, WeightManifest, module_group, plan_buckets, typed_view, unpack
from sfhpc.weights.transport import Transfer, WeightTransport

if TYPE_CHECKING:
    from sfhpc.weights.version_server import VersionServer

DEFAULT_BUCKET_BYTES = 32 << 20

HEADER_WORDS = 4  # kind, version, layout hash, number of messages
_FINISH, _SAME_LAYOUT, _NEW_LAYOUT, _DELTA = 0, 1, 2, 3
TABLE_COLUMNS = 3  # per bucket of a delta version: encoding, payload bytes, checksum


@dataclasses.dataclass(frozen=True)
class PublishStats:
    version: int
    tensors: int
    bytes: int  # bucket bytes, padding included
    buckets: int
    messages: int
    stage_seconds: float  # casting/copying the tensors into staging (receivers not involved)
    send_seconds: float  # header, manifest if sent, every message, as the source saw it
    manifest_sent: bool
    wire_bytes: int = -1  # what crossed the wire: `bytes` for a whole version, less for a delta (-1: `bytes`)
    encodings: tuple[int, ...] = ()  # buckets sent in each encoding of `sfhpc.weights.delta` (delta versions)

    def __post_init__(self) -> None:
        if self.wire_bytes < 0:
            object.__setattr__(self, "wire_bytes", self.bytes)

    @property
    def seconds(self) -> float:
        return self.stage_seconds + self.send_seconds

    @property
    def bandwidth(self) -> float:
        """Bytes per second of the send, as seen by the source."""
        return self.bytes / self.send_seconds if self.send_seconds > 0 else float("inf")


class _Staging:
    """What the source keeps per layout: the manifest, one transport buffer holding every bucket back to
    back, a typed view of each tensor in it and the transport's handle of each message."""

    def __init__(self, key: object, manifest: WeightManifest, transport: WeightTransport) -> None:
        self.key = key
        self.manifest = manifest
        # Bucket sizes are multiples of the manifest's alignment, so every tensor view stays aligned.
        starts = [0, *itertools.accumulate(manifest.bucket_sizes)]
        self.buffer = transport.allocate(manifest.total_bytes) if manifest.total_bytes else None
        self.views: list[torch.Tensor | None] = [
            typed_view(self.buffer, meta, base=-starts[meta.bucket]) if meta.nbytes and self.buffer is not None
            else None for meta in manifest.tensors]
        self.starts = starts
        self.wires = [transport.wire(self.buffer, starts[m.bucket] + m.offset, m.nbytes)
                      for m in manifest.messages] if self.buffer is not None else []
        self.bucket_wires: list[list[object]] = [[] for _ in manifest.bucket_sizes]  # each bucket's messages
        for message, wire in zip(manifest.messages, self.wires):
            self.bucket_wires[message.bucket].append(wire)

    def bucket(self, index: int) -> torch.Tensor:
        assert self.buffer is not None
        return self.buffer[self.starts[index]:self.starts[index + 1]]


class _Changes:
    """The delta of the version in staging against the one before it, bucket by bucket (`stage` fills it)."""

    def __init__(self, buckets: int) -> None:
        self.encodings = [delta.SAME] * buckets
        self.payloads: list[torch.Tensor | None] = [None] * buckets
        self.checksums = [0] * buckets

    def add(self, index: int, mask: torch.Tensor, bucket: torch.Tensor) -> None:
        encoding, payload = delta.encode(mask, delta.words(bucket))
        self.encodings[index] = encoding
        self.payloads[index] = payload if payload.numel() else None
        if encoding != delta.SAME:
            self.checksums[index] = delta.checksum(bucket)


class WeightPublisher:
    """The sending side; lives on the transport's source rank."""

    def __init__(self, transport: WeightTransport, bucket_bytes: int = DEFAULT_BUCKET_BYTES, *,
                 group: Callable[[str], str] | None = module_group, delta: bool = False) -> None:
        if not transport.is_source:
            raise ValueError("a WeightPublisher lives on the transport's source rank; use WeightReceiver elsewhere")
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self.group = group
        self.delta = delta
        self._staging: _Staging | None = None
        self._receivers_hold_staging = False  # staging holds the last version sent (what a delta is taken against)
        self._changes: _Changes | None = None  # the delta of the version in staging; None: it goes whole
        self._payload: torch.Tensor | None = None  # transport memory the encoded buckets are sent from (grows)
        self._announced: int | None = None  # layout hash the receivers hold the manifest of
        self._staged: tuple[int, float] | None = None  # tensors and seconds of the version in staging, unsent
        self._header = torch.zeros(HEADER_WORDS, dtype=torch.int64)
        self._header_words = self._header.numpy()  # written in place: no tensor built per version
        # Receivers outside the group (rollout workers of other jobs) pull each version from staging after it was
        # sent (`sfhpc.weights.version_server`); staging a version waits for their pulls of the one before.
        self.late: VersionServer | None = None

    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int, *,
                dtype: torch.dtype | None = None) -> PublishStats:
        """Stage `named` and send it as `version`; returns when every message has left this rank."""
        self.stage(named, dtype=dtype)
        return self.send(version)

    def stage(self, named: Iterable[tuple[str, torch.Tensor]], *, dtype: torch.dtype | None = None) -> float:
        """Cast or copy one version into staging (receivers are not involved); returns the seconds taken.

        `named` may be a generator; its tensors are read once, in order. With `dtype` (e.g.
        ``torch.bfloat16`` from float32 master weights) tensors are cast on the way. A new set of names,
        shapes or dtypes is a new layout: its staging is allocated here and its manifest goes with the
        next `send`.
        """
        start = time.perf_counter()
        if self.late is not None:
            self.late.hold()
        items = [(name, tensor.detach()) for name, tensor in named]
        key = (dtype, tuple((n, tuple(t.shape), t.dtype) for n, t in items))
        if self._staging is None or self._staging.key != key:
            manifest = plan_buckets(items, 0, self.bucket_bytes, dtype=dtype, group=self.group)
            self._staging = None  # let the previous layout's buffer go before allocating the next
            self._staging = _Staging(key, manifest, self.transport)
            self._receivers_hold_staging = False
        if self.delta and self._receivers_hold_staging:
            self._changes = self._stage_comparing(items)
        else:
            self._changes = None
            for view, (_, tensor) in zip(self._staging.views, items):
                if view is not None:
                    view.copy_(tensor)  # cast and copy in one pass
        self._receivers_hold_staging = False
        seconds = time.perf_counter() - start
        self._staged = (len(items), seconds)
        return seconds

    def _stage_comparing(self, items: list[tuple[str, torch.Tensor]]) -> _Changes:
        """Copy `items` into staging, which holds the version the receivers have, and note per 2-byte word what
        changed, one bucket at a time (a bucket's mask is the only memory this takes beyond a tensor's copy)."""
        staging = self._staging
        assert staging is not None
        manifest = staging.manifest
        changes = _Changes(manifest.num_buckets)
        current, mask = -1, torch.zeros(0, dtype=torch.bool)
        for meta, view, (_, tensor) in zip(manifest.tensors, staging.views, items):
            if view is None:
                continue
            if meta.bucket != current:
                if current >= 0:
                    changes.add(current, mask, staging.bucket(current))
                current = meta.bucket
                mask = torch.zeros(manifest.bucket_sizes[current] // 2, dtype=torch.bool, device=view.device)
            words = delta.words(staging.bucket(current))[meta.offset // 2:(meta.offset + meta.nbytes + 1) // 2]
            before = words.clone()
            view.copy_(tensor)
            torch.ne(words, before, out=mask[meta.offset // 2:meta.offset // 2 + words.numel()])
        if current >= 0:
            changes.add(current, mask, staging.bucket(current))
        return changes

    def send(self, version: int) -> PublishStats:
        """Broadcast what is staged as `version`; returns when every message has left this rank's memory.
        Staging must not change until then."""
        if self._staging is None or self._staged is None:
            raise WeightStreamError("nothing is staged: call stage() (or publish()) before send()")
        changes = self._changes
        if changes is not None and any(e != delta.FULL for e in changes.encodings):
            return self._send_delta(version, changes)
        # Every bucket changed beyond what an encoding saves: the version goes whole (no table to send).
        start = time.perf_counter()
        manifest = self._staging.manifest
        new_layout = self._announced != manifest.layout
        self._header_words[:] = (_NEW_LAYOUT if new_layout else _SAME_LAYOUT, version, manifest.layout,
                                 len(manifest.messages))
        # The header's completion is waited for with the rest (the header buffer is not touched before).
        transfers: list[Transfer] = [self.transport.post_header(self._header)]
        if new_layout:
            self.transport.share_manifest(dataclasses.replace(manifest, version=version))
            self._announced = manifest.layout
        transfers.append(self.transport.post(self._staging.wires))
        self.transport.wait_all(transfers)
        tensors, stage_seconds = self._staged
        self._sent(version, changes)
        return PublishStats(version=version, tensors=tensors, bytes=manifest.total_bytes,
                            buckets=manifest.num_buckets, messages=len(manifest.messages),
                            stage_seconds=stage_seconds, send_seconds=time.perf_counter() - start,
                            manifest_sent=new_layout)

    def _send_delta(self, version: int, changes: _Changes) -> PublishStats:
        """The header, the table of bucket encodings, then each changed bucket: whole from staging, or its
        encoding from the payload buffer."""
        staging = self._staging
        assert staging is not None and self._staged is not None
        start = time.perf_counter()
        manifest = staging.manifest
        starts = _aligned_starts(0 if p is None else p.numel() for p in changes.payloads)
        if starts[-1] and (self._payload is None or self._payload.numel() < starts[-1]):
            self._payload = None
            self._payload = self.transport.allocate(starts[-1] + starts[-1] // 2)  # room to grow without a new one
        messages: list[object] = []
        for index, encoding in enumerate(changes.encodings):
            payload = changes.payloads[index]
            if encoding == delta.FULL:
                messages += staging.bucket_wires[index]
            elif payload is not None:
                assert self._payload is not None
                end = starts[index] + payload.numel()
                self._payload[starts[index]:end].copy_(payload)
                messages += [self.transport.wire(self._payload, at, min(MAX_MESSAGE, end - at))
                             for at in range(starts[index], end, MAX_MESSAGE)]
        table = torch.tensor([[e, 0 if p is None else p.numel(), c] for e, p, c in
                              zip(changes.encodings, changes.payloads, changes.checksums)], dtype=torch.int64)
        self._header_words[:] = (_DELTA, version, manifest.layout, len(messages))
        transfers = [self.transport.post_header(self._header), self.transport.post_header(table)]
        if messages:
            transfers.append(self.transport.post(messages))
        self.transport.wait_all(transfers)
        tensors, stage_seconds = self._staged
        self._sent(version, changes)
        sent = sum(size for e, size in zip(changes.encodings, manifest.bucket_sizes) if e == delta.FULL)
        sent += sum(p.numel() for p in changes.payloads if p is not None) + table.numel() * 8
        counts = tuple(changes.encodings.count(e) for e in range(len(delta.ENCODINGS)))
        return PublishStats(version=version, tensors=tensors, bytes=manifest.total_bytes,
                            buckets=manifest.num_buckets, messages=len(messages), stage_seconds=stage_seconds,
                            send_seconds=time.perf_counter() - start, manifest_sent=False, wire_bytes=sent,
                            encodings=counts)

    def _sent(self, version: int, changes: _Changes | None) -> None:
        """Staging now holds what every receiver holds, `version`: the next delta is taken against it."""
        assert self._staging is not None
        self._staged, self._changes = None, None
        self._receivers_hold_staging = True
        if self.late is not None:
            self.late.sent(version, self._staging, changes)

    def finish(self) -> None:
        """Tell every receiver there are no more versions (their `receive` returns None)."""
        if self.late is not None:
            self.late.close()
        self._header_words[:] = (_FINISH, 0, 0, 0)
        self.transport.post_header(self._header).wait()
        self.transport.close()


def _aligned_starts(sizes: Iterable[int]) -> list[int]:
    """Where each bucket's encoding (of `sizes` bytes) starts in a payload buffer (aligned), and the buffer's
    size last."""
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + (size + delta.ALIGN - 1) // delta.ALIGN * delta.ALIGN)
    return starts


class _ReceiverLayout:
    """What a receiver keeps per layout: the manifest and, when buffers are reused, the bucket slots with
    their message and tensor views (built once, reused by every version)."""

    def __init__(self, manifest: WeightManifest, receiver: WeightReceiver,
                 previous: _ReceiverLayout | None) -> None:
        self.manifest = manifest
        self._receiver = receiver
        self._cache: dict[int, tuple[list[object], list[tuple[str, torch.Tensor]]]] = {}
        self._slots: list[torch.Tensor] = []
        # A receiver that keeps a copy: every bucket, back to back (what a delta is applied to, what a restarted
        # engine loads), and the version it holds (None: no whole version yet).
        self.copy: torch.Tensor | None = None
        self.held_version: int | None = None
        self._payload: torch.Tensor | None = None
        if receiver.keep_copy:
            self.starts = [0, *itertools.accumulate(manifest.bucket_sizes)]
            self.copy = receiver.transport.allocate(manifest.total_bytes) if manifest.total_bytes else None
        elif receiver.reuse_buffers:
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
        if self._receiver.keep_copy:
            buffer = self.copy_of(index)
            wire = self._receiver.transport.wire
            views = ([wire(buffer, m.offset, m.nbytes) for m in self.manifest.bucket_messages(index)],
                     unpack(buffer, self.manifest.bucket(index)))
            self._cache[index] = views
            return views
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


    def copy_of(self, index: int) -> torch.Tensor:
        """This receiver's copy of bucket `index`."""
        assert self.copy is not None
        return self.copy[self.starts[index]:self.starts[index + 1]]

    def payload(self, nbytes: int) -> torch.Tensor:
        """Memory to receive a delta's encodings into (grown as needed, kept)."""
        if self._payload is None or self._payload.numel() < nbytes:
            self._payload = None
            self._payload = self._receiver.transport.allocate(nbytes + nbytes // 2)
        return self._payload


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
            if self.done and self._receiver.keep_copy:
                self._layout.held_version = self.version  # every bucket of a whole version is in the copy
            yield views

    def arrived(self) -> bool:
        """Post every bucket still to come and say, without blocking, whether all of them are in: a receiver
        that keeps a copy receives a whole version into it while its engine goes on generating, and then
        iterates the buckets at once (`sfhpc.engine.weight_sync.receive_aside`)."""
        if not self._receiver.keep_copy:
            raise WeightStreamError("only a receiver that keeps a copy can take a whole version before loading it")
        for index in range(self._next, self.num_buckets):
            self._post(index)
        return all(transfer.test() for transfer, _ in self._posted.values())

    @property
    def lands_in_engine(self) -> bool:
        """True when the engine's own processes receive the buckets (`WeightTransport.engine_receives`): hand
        `manifest` to the engine (`RolloutEngine.receive_weights`), then call `landed`; do not iterate."""
        return self._receiver.transport.engine_receives

    def landed(self) -> None:
        """The engine received every bucket itself: the version is consumed here too."""
        if not self.lands_in_engine:
            raise WeightStreamError("this rank receives the buckets itself: iterate or drain() them")
        if not self.done:
            self._next = self.num_buckets
            self._receiver._post_header()

    def drain(self) -> None:
        """Receive and drop the remaining buckets (collective: the other ranks wait for them). Where the
        engine receives them, only the engine can: call `RolloutEngine.receive_weights(..., load=False)`."""
        if self.lands_in_engine:
            self.landed()
            return
        for _ in self:
            pass

    def _post(self, index: int) -> None:
        if index not in self._posted:
            messages, views = self._layout.bucket(index)
            self._posted[index] = (self._receiver.transport.post(messages), views)
            if index == self.num_buckets - 1:
                self._receiver._post_header()  # the next header may now be matched, in order


class IncomingDelta(IncomingWeights):
    """A delta version on its way in: every message is posted at once (whole buckets into the receiver's copy,
    encodings into its payload buffer); iterating applies each changed bucket's delta to the copy, checks its
    checksum and yields it. Only the buckets that changed are yielded (`num_buckets` counts them)."""

    def __init__(self, receiver: WeightReceiver, layout: _ReceiverLayout, version: int, table: torch.Tensor,
                 messages: int) -> None:
        super().__init__(receiver, layout, version)
        rows = [tuple(int(x) for x in row) for row in table.tolist()]
        self._changed = [(index, encoding, size, checksum) for index, (encoding, size, checksum) in enumerate(rows)
                         if encoding != delta.SAME]
        starts = _aligned_starts(0 if e == delta.FULL else n for e, n, _ in rows)
        payload = layout.payload(starts[-1]) if starts[-1] else None
        wire = receiver.transport.wire
        wires: list[object] = []
        self._encoded: dict[int, torch.Tensor] = {}
        for index, encoding, size, _ in self._changed:
            if encoding == delta.FULL:
                wires += layout.bucket(index)[0]
            else:
                assert payload is not None
                self._encoded[index] = payload[starts[index]:starts[index] + size]
                wires += [wire(payload, at, min(MAX_MESSAGE, starts[index] + size - at))
                          for at in range(starts[index], starts[index] + size, MAX_MESSAGE)]
        if len(wires) != messages:
            raise WeightStreamError(f"version {version}: the delta's table gives {len(wires)} messages, its header "
                                    f"{messages}: publisher and receiver disagree")
        self._transfer = receiver.transport.post(wires) if wires else None
        receiver._post_header()  # every message of this version is posted: the next header may be matched

    @property
    def num_buckets(self) -> int:
        return len(self._changed)

    def __iter__(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        if self._transfer is not None:
            self._transfer.wait()
            self._transfer = None
        layout = self._layout
        while not self.done:
            index, encoding, _, expected = self._changed[self._next]
            bucket = layout.copy_of(index)
            if encoding != delta.FULL:
                delta.apply(delta.words(bucket), encoding, self._encoded[index])
            if delta.checksum(bucket) != expected:
                raise WeightStreamError(f"version {self.version}: bucket {index} differs from the publisher's after "
                                        f"its {delta.ENCODINGS[encoding]} update (checksum mismatch)")
            self._next += 1
            if self.done:
                layout.held_version = self.version
            yield layout.bucket(index)[1]

    def arrived(self) -> bool:
        if self._transfer is not None and self._transfer.test():
            self._transfer = None
        return self._transfer is None

    def _post(self, index: int) -> None:
        raise AssertionError("a delta version posts every message when it arrives")


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

    def __init__(self, transport: WeightTransport, *, reuse_buffers: bool = True, depth: int = 2,
                 keep_copy: bool = False) -> None:
        if transport.is_source:
            raise ValueError("the transport's source rank publishes; use WeightPublisher there")
        if depth < 1:
            raise ValueError(f"depth must be at least 1 bucket buffer, found {depth}")
        if keep_copy and transport.engine_receives:
            raise WeightStreamError("a receiver that keeps a copy of the weights receives them itself, and this "
                                    "rank's engine receives them in its own processes")
        self.transport = transport
        self.reuse_buffers = reuse_buffers
        self.depth = depth
        # Keep a copy of every bucket: versions may then come as deltas against it (`WeightPublisher(delta=True)`),
        # and `held_weights` gives the last version whole (a restarted engine's weights).
        self.keep_copy = keep_copy
        self._layout: _ReceiverLayout | None = None
        self._current: IncomingWeights | None = None
        self._pending: PendingVersion | None = None

    def start(self) -> PendingVersion:
        """Begin waiting for the next header (non-blocking); the same object until its result is taken."""
        if self._current is not None and not self._current.done:
            raise WeightStreamError(f"version {self._current.version} still has buckets on the wire: "
                                    "iterate or drain() it before receiving the next version")
        if self._pending is None:
            self._post_header()
        assert self._pending is not None
        return self._pending

    def held_weights(self) -> tuple[int, list[tuple[str, torch.Tensor]]] | None:
        """The last version this receiver took whole (a receiver that keeps a copy), as its version and
        ``(name, tensor)`` views into the copy; None before the first. Not while a version is on its way."""
        layout = self._layout
        if layout is None or layout.held_version is None:
            return None
        return layout.held_version, [named for index in range(layout.manifest.num_buckets)
                                     for named in unpack(layout.copy_of(index), layout.manifest.bucket(index))]

    def _post_header(self) -> None:
        # Posted as soon as the previous version's last bucket is (collectives match in posting order),
        # so the header is already waiting when the publisher sends: a version costs the publisher's
        # latency once, not once more for a receiver that only starts listening when asked.
        header = torch.zeros(HEADER_WORDS, dtype=torch.int64)
        self._pending = PendingVersion(self, header, self.transport.post_header(header))

    def receive(self) -> IncomingWeights | None:
        """Wait for the next version; None once the publisher has called `finish`.

        The previous version's buckets must all have been consumed (`IncomingWeights.drain`)."""
        return self.start().result()

    def _accept(self, header: list[int]) -> IncomingWeights | None:
        self._pending = None
        kind, version, layout, messages = header
        if kind == _FINISH:
            self._current = None
            self.transport.close()
            return None
        if kind == _NEW_LAYOUT:
            manifest = self.transport.share_manifest(None)
            if manifest is None or manifest.layout != layout:
                raise WeightStreamError("the manifest that followed a header does not match its layout hash")
            self._layout = _ReceiverLayout(manifest, self, self._layout)
        elif kind not in (_SAME_LAYOUT, _DELTA):
            raise WeightStreamError(f"unknown weight header kind {kind}: publisher and receiver disagree")
        if self._layout is None or self._layout.manifest.layout != layout or \
                (kind != _DELTA and len(self._layout.manifest.messages) != messages):
            raise WeightStreamError(f"version {version} announces a layout this receiver never got a manifest for")
        if kind == _DELTA:
            table = torch.zeros(self._layout.manifest.num_buckets, TABLE_COLUMNS, dtype=torch.int64)
            self.transport.post_header(table).wait()  # the table follows its header on the same channel
            if not self.keep_copy or self._layout.held_version is None:
                raise WeightStreamError(f"version {version} came as a delta, and this receiver "
                                        + ("keeps no copy to apply it to" if not self.keep_copy else
                                           "never got the whole version before it"))
            self._current = IncomingDelta(self, self._layout, version, table, messages)
            return self._current
        self._current = IncomingWeights(self, self._layout, version)
        if self._current.num_buckets == 0:
            self._post_header()
        return self._current
