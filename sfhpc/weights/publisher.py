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
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Iterator

import torch

from sfhpc.weights.errors import WeightStreamError
from sfhpc.weights.manifest import WeightManifest, module_group, plan_buckets, typed_view, unpack
from sfhpc.weights.transport import Transfer, WeightTransport

DEFAULT_BUCKET_BYTES = 32 << 20

HEADER_WORDS = 4  # kind, version, layout hash, number of messages
_FINISH, _SAME_LAYOUT, _NEW_LAYOUT = 0, 1, 2


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
        self.wires = [transport.wire(self.buffer, starts[m.bucket] + m.offset, m.nbytes)
                      for m in manifest.messages] if self.buffer is not None else []


class WeightPublisher:
    """The sending side; lives on the transport's source rank."""

    def __init__(self, transport: WeightTransport, bucket_bytes: int = DEFAULT_BUCKET_BYTES, *,
                 group: Callable[[str], str] | None = module_group) -> None:
        if not transport.is_source:
            raise ValueError("a WeightPublisher lives on the transport's source rank; use WeightReceiver elsewhere")
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self.group = group
        self._staging: _Staging | None = None
        self._announced: int | None = None  # layout hash the receivers hold the manifest of
        self._staged: tuple[int, float] | None = None  # tensors and seconds of the version in staging, unsent
        self._header = torch.zeros(HEADER_WORDS, dtype=torch.int64)
        self._header_words = self._header.numpy()  # written in place: no tensor built per version

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
        items = [(name, tensor.detach()) for name, tensor in named]
        key = (dtype, tuple((n, tuple(t.shape), t.dtype) for n, t in items))
        if self._staging is None or self._staging.key != key:
            manifest = plan_buckets(items, 0, self.bucket_bytes, dtype=dtype, group=self.group)
            self._staging = None  # let the previous layout's buffer go before allocating the next
            self._staging = _Staging(key, manifest, self.transport)
        for view, (_, tensor) in zip(self._staging.views, items):
            if view is not None:
                view.copy_(tensor)  # cast and copy in one pass
        seconds = time.perf_counter() - start
        self._staged = (len(items), seconds)
        return seconds

    def send(self, version: int) -> PublishStats:
        """Broadcast what is staged as `version`; returns when every message has left this rank's memory.
        Staging must not change until then."""
        if self._staging is None or self._staged is None:
            raise WeightStreamError("nothing is staged: call stage() (or publish()) before send()")
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
        self._staged = None
        return PublishStats(version=version, tensors=tensors, bytes=manifest.total_bytes,
                            buckets=manifest.num_buckets, messages=len(manifest.messages),
                            stage_seconds=stage_seconds, send_seconds=time.perf_counter() - start,
                            manifest_sent=new_layout)

    def finish(self) -> None:
        """Tell every receiver there are no more versions (their `receive` returns None)."""
        self._header_words[:] = (_FINISH, 0, 0, 0)
        self.transport.post_header(self._header).wait()
        self.transport.close()


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
        if self._current is not None and not self._current.done:
            raise WeightStreamError(f"version {self._current.version} still has buckets on the wire: "
                                    "iterate or drain() it before receiving the next version")
        if self._pending is None:
            self._post_header()
        assert self._pending is not None
        return self._pending

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
        elif kind != _SAME_LAYOUT:
            raise WeightStreamError(f"unknown weight header kind {kind}: publisher and receiver disagree")
        if self._layout is None or self._layout.manifest.layout != layout or \
                len(self._layout.manifest.messages) != messages:
            raise WeightStreamError(f"version {version} announces a layout this receiver never got a manifest for")
        self._current = IncomingWeights(self, self._layout, version)
        if self._current.num_buckets == 0:
            self._post_header()
        return self._current
