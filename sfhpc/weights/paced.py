"""The timing scale's network: a weight transport whose buckets arrive no sooner than a modelled link allows.

Benchmarks only (``timing_model.weight_transfer_s``). At the timing scale a run broadcasts a tiny policy's
bytes while its engines and trainer stand in for a 7B's; the real transfer is over in microseconds, where a 7B's
version takes about a second and a half on a rollout node's network. `PacedLink` wraps the rank's real
transport and holds each bucket's transfer back until the modelled link has carried its share of a whole
version (the bucket's bytes over the version's), one transfer after the other as on one link. The wait is
where the code waits for the network: inside the engine's pause when the rank loads the version as it arrives,
before the pause when the version is staged (``engine.staged_updates``). A delta version is its bytes' share.
Headers and a delta's table travel unpaced (32 bytes and a few per bucket: latency, not bandwidth).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from sfhpc.weights.manifest import WeightManifest
from sfhpc.weights.transport import Transfer, WeightTransport


class _Paced(Transfer):
    def __init__(self, inner: Transfer, ready_at: float) -> None:
        self._inner = inner
        self._ready_at = ready_at

    def test(self) -> bool:
        return self._inner.test() and time.monotonic() >= self._ready_at

    def wait(self) -> None:
        self._inner.wait()
        time.sleep(max(0.0, self._ready_at - time.monotonic()))


class PacedLink(WeightTransport):
    """`inner` on a receiving rank, with a whole version taking `version_s` seconds on the link."""

    def __init__(self, inner: WeightTransport, version_s: float) -> None:
        if inner.is_source:
            raise ValueError("the link is paced where the weights arrive: wrap a receiver's transport")
        if version_s < 0:
            raise ValueError(f"a version's transfer takes 0 or more seconds, found {version_s}")
        self.inner = inner
        self.version_s = version_s
        self._version_bytes = 0
        self._free_at = 0.0  # when the link has carried everything posted so far

    @property
    def is_source(self) -> bool:
        return False

    @property
    def size(self) -> int:
        return self.inner.size

    @property
    def engine_receives(self) -> bool:
        return self.inner.engine_receives

    def share_manifest(self, manifest: WeightManifest | None) -> WeightManifest | None:
        shared = self.inner.share_manifest(manifest)
        if shared is not None:
            self._version_bytes = shared.total_bytes
        return shared

    def allocate(self, nbytes: int) -> torch.Tensor:
        return self.inner.allocate(nbytes)

    def wire(self, tensor: torch.Tensor, start: int = 0, nbytes: int | None = None) -> Any:
        return self.inner.wire(tensor, start, nbytes)

    def post_header(self, header: torch.Tensor) -> Transfer:
        return self.inner.post_header(header)

    def close(self) -> None:
        self.inner.close()

    def post(self, messages: Sequence[Any]) -> Transfer:
        transfer = self.inner.post(messages)
        share = sum(_nbytes(m) for m in messages) / max(self._version_bytes, 1)
        self._free_at = max(time.monotonic(), self._free_at) + self.version_s * share
        return _Paced(transfer, self._free_at)


def _nbytes(message: Any) -> int:
    """A `wire` handle's length: an MPI buffer's or a tensor's bytes."""
    if isinstance(message, torch.Tensor):
        return message.numel() * message.element_size()
    return len(message)
