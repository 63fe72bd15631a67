"""Weight versions for receivers outside the broadcast group: rollout workers of other jobs (`sfhpc attach`).

A broadcast group is fixed when the run starts, and every member takes part in every version. A worker that
joins later, or leaves without a word, cannot be one. The publishing rank serves them instead: after each
send, `VersionServer` holds the version in the publisher's staging (and, with ``engine.weight_delta``, what
changed since the version before) and answers each worker's pull over a TCP connection of its own, authenticated
with a key of the server's (`multiprocessing.connection`'s HMAC handshake), found with its address in the run
folder's register (``attach/weights.json``, mode 0600).

A pull names the version the worker wants and the one it holds: a worker holding the version just before gets
the delta (`sfhpc.weights.delta`: only what changed, bit-exact), any other worker, one that just joined or fell
more than one version behind, gets the version whole. Every bucket sent travels with its checksum, which the
worker checks after landing it in its copy. The worker (`VersionPuller`) keeps that copy of every bucket: what
its engine loads, what a delta applies to, what a restarted engine starts from.

Staging is the publisher's: while a pull reads it the next version waits to be staged (`hold`), so the trainer
may wait for the slowest pull in flight, never for a worker that is not pulling. Bytes go straight from staging
to the socket and from the socket into the worker's copy (``send_bytes`` / ``recv_bytes_into``), no pickling.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sfhpc.door import Door, knock
from sfhpc.weights import delta
from sfhpc.weights.errors import WeightStreamError
from sfhpc.weights.manifest import WeightManifest, unpack

if TYPE_CHECKING:
    from sfhpc.weights.publisher import _Changes, _Staging

log = logging.getLogger("sfhpc")
REGISTER_NAME = "weights"
PULL_TIMEOUT_S = 1800.0  # how long a pull waits for the version it wants to be published


class VersionServer:
    """On the publisher's rank: serves each version the publisher sent to workers that pull it (see the module)."""

    def __init__(self, register: Path, *, bind: str = "0.0.0.0") -> None:
        self._state = threading.Condition()
        self._version = 0
        self._staging: _Staging | None = None
        self._changes: _Changes | None = None
        self._staging_changes = False  # the publisher is staging the next version: pulls wait
        self._reading = 0  # pulls reading staging now
        self._closed = False
        self.pulls = 0  # pulls served, for the run's figures
        self.bytes_sent = 0
        self.door = Door(register, REGISTER_NAME, lambda connection: threading.Thread(
            target=self._serve, args=(connection,), name="sfhpc-weight-pull", daemon=True).start(), bind=bind)

    # -- the publisher's side ----------------------------------------------------------------------------
    def hold(self) -> None:
        """The publisher stages the next version: wait for the pulls reading staging, and let none start."""
        with self._state:
            self._staging_changes = True
            self._state.wait_for(lambda: self._reading == 0)

    def sent(self, version: int, staging: _Staging, changes: _Changes | None) -> None:
        """The publisher sent `version` from `staging` (`changes`: its delta from the version before, or None)."""
        with self._state:
            self._version, self._staging, self._changes = version, staging, changes
            self._staging_changes = False
            self._state.notify_all()

    def close(self) -> None:
        with self._state:
            self._closed = True
            self._state.notify_all()
        self.door.close()

    # -- the workers' side -------------------------------------------------------------------------------
    def _serve(self, connection: Connection) -> None:
        with contextlib.closing(connection):
            try:
                while True:
                    kind, want, held, layout = connection.recv()
                    if kind != "pull":
                        raise WeightStreamError(f"unknown request {kind!r}")
                    self._answer(connection, want, held, layout)
            except (EOFError, OSError):
                return  # the worker went
            except Exception as exc:  # noqa: BLE001 (told to the worker, which fails its sync with it)
                log.warning("weight server: a pull failed: %s", exc)
                with contextlib.suppress(OSError):
                    connection.send(("error", f"{type(exc).__name__}: {exc}"))

    def _answer(self, connection: Connection, want: int | None, held: int | None, layout: int | None) -> None:
        with self._state:
            if want is None and self._version == 0:  # nothing published yet: the folder's weights are current
                connection.send(("none",))
                return
            arrived = self._state.wait_for(lambda: self._closed or (
                not self._staging_changes and self._staging is not None and self._version >= (want or 0)),
                PULL_TIMEOUT_S)
            if self._closed or not arrived:
                raise WeightStreamError(f"version {want} was not published within {PULL_TIMEOUT_S:g} s")
            if want is not None and want != self._version:
                raise WeightStreamError(f"version {want} was wanted; the publisher holds version {self._version}")
            version, staging, changes = self._version, self._staging, self._changes
            assert staging is not None
            self._reading += 1
        try:
            manifest = staging.manifest
            same_layout = layout == manifest.layout
            as_delta = changes is not None and same_layout and held == version - 1
            rows: list[tuple[int, int, int]] = []
            for index, size in enumerate(manifest.bucket_sizes):
                if as_delta:
                    assert changes is not None
                    payload = changes.payloads[index]
                    rows.append((changes.encodings[index], size if payload is None else payload.numel(),
                                 changes.checksums[index]))
                else:
                    rows.append((delta.FULL, size, delta.checksum(staging.bucket(index))))
            connection.send(("version", version, None if same_layout else manifest, rows))
            sent = 0
            for index, (encoding, size, _) in enumerate(rows):
                if encoding == delta.SAME:
                    continue
                data = staging.bucket(index) if encoding == delta.FULL else changes.payloads[index]  # type: ignore[union-attr]
                assert data is not None and data.numel() == size
                connection.send_bytes(data.cpu().numpy().data)
                sent += size
            self.pulls += 1
            self.bytes_sent += sent
        finally:
            with self._state:
                self._reading -= 1
                self._state.notify_all()


class PulledVersion:
    """A version pulled into the puller's copy, for `sfhpc.engine.weight_sync.apply_version`: its buckets that
    changed, each as ``(name, tensor)`` views into the copy."""

    lands_in_engine = False

    def __init__(self, puller: VersionPuller, version: int, changed: list[int]) -> None:
        self._puller, self.version, self._changed = puller, version, changed

    @property
    def manifest(self) -> WeightManifest:
        assert self._puller.manifest is not None
        return self._puller.manifest

    @property
    def num_buckets(self) -> int:
        return len(self._changed)

    def __iter__(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        for index in self._changed:
            yield self._puller.bucket(index)

    def drain(self) -> None:
        """Nothing is on the wire: the version is in the copy already."""


class VersionPuller:
    """A worker's side of `VersionServer`: pulls versions into a copy of its own (see the module)."""

    def __init__(self, register: Path, *, timeout_s: float = 120.0) -> None:
        # (the trainer registers it when its weight stream opens)
        self._connection = knock(register, REGISTER_NAME, timeout_s=timeout_s, what="weight server")
        self.register_file = register / f"{REGISTER_NAME}.json"  # (named in its errors)
        self.manifest: WeightManifest | None = None
        self._copy: torch.Tensor | None = None
        self._starts: list[int] = []
        self.held: int | None = None  # the version the copy holds whole (None: none yet, the folder's weights)
        self.bytes_received = 0  # the last pull's

    def pull(self, want: int | None = None) -> PulledVersion | None:
        """Version `want` (None: the latest published; None comes back when nothing was published yet)."""
        layout = None if self.manifest is None else self.manifest.layout
        self._connection.send(("pull", want, self.held, layout))
        reply = self._connection.recv()
        if reply[0] == "none":
            return None
        if reply[0] != "version":
            raise WeightStreamError(f"the weight server ({self.register_file}) refused the pull of version {want}: "
                                    f"{reply[1]}")
        _, version, manifest, rows = reply
        if manifest is not None:
            self._new_layout(manifest)
        elif self.manifest is None:
            raise WeightStreamError("the weight server sent a version without the layout this worker never got")
        changed, received = [], 0
        for index, (encoding, size, expected) in enumerate(rows):
            if encoding == delta.SAME:
                continue
            bucket = self._bucket_bytes(index)
            if encoding == delta.FULL:
                self._connection.recv_bytes_into(bucket.numpy().data)
            else:
                if self.held != version - 1:
                    raise WeightStreamError(f"version {version} came as a delta over version {version - 1}; this "
                                            f"worker holds {self.held}")
                payload = torch.frombuffer(bytearray(self._connection.recv_bytes()), dtype=torch.uint8)
                delta.apply(delta.words(bucket), encoding, payload)
            received += size
            if delta.checksum(bucket) != expected:
                raise WeightStreamError(f"version {version}: bucket {index} differs from the publisher's after its "
                                        f"{delta.ENCODINGS[encoding]} update (checksum mismatch)")
            changed.append(index)
        self.held, self.bytes_received = version, received
        return PulledVersion(self, version, changed)

    def _new_layout(self, manifest: WeightManifest) -> None:
        import itertools

        self.manifest, self.held = manifest, None
        self._starts = [0, *itertools.accumulate(manifest.bucket_sizes)]
        self._copy = None
        self._copy = torch.empty(manifest.total_bytes, dtype=torch.uint8)

    def _bucket_bytes(self, index: int) -> torch.Tensor:
        assert self._copy is not None
        return self._copy[self._starts[index]:self._starts[index + 1]]

    def bucket(self, index: int) -> list[tuple[str, torch.Tensor]]:
        assert self.manifest is not None
        return unpack(self._bucket_bytes(index), self.manifest.bucket(index))

    def held_weights(self) -> tuple[int, list[tuple[str, torch.Tensor]]] | None:
        """The version the copy holds and its ``(name, tensor)`` views (a restarted engine's weights); None before
        the first pull."""
        if self.held is None or self.manifest is None:
            return None
        return self.held, [named for index in range(self.manifest.num_buckets) for named in self.bucket(index)]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._connection.close()

