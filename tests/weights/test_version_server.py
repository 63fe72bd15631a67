"""Weight versions for workers outside the broadcast group (`sfhpc.weights.version_server`): a worker that joins
gets the latest version whole, one version behind it gets only what changed (with ``delta``), further behind the
version whole again; every pull lands the publisher's exact bytes."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from sfhpc.weights.errors import WeightStreamError
from sfhpc.weights.publisher import WeightPublisher
from sfhpc.weights.transport import Transfer, WeightTransport
from sfhpc.weights.version_server import VersionPuller, VersionServer


class _Done(Transfer):
    def test(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class NoMembers(WeightTransport):
    """A broadcast group of the source alone (a run whose engines all pull): what is posted is complete at once."""

    is_source = True
    size = 1

    def share_manifest(self, manifest: Any) -> Any:
        return manifest

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8)

    def wire(self, tensor: torch.Tensor, start: int = 0, nbytes: int | None = None) -> Any:
        return (tensor, start, nbytes)

    def post(self, messages: Sequence[Any]) -> Transfer:
        return _Done()


def weights(step: int) -> list[tuple[str, torch.Tensor]]:
    """A model whose step `step` changes a few elements of one tensor of four (as an RL step at a small rate)."""
    gen = torch.Generator().manual_seed(0)
    named = [(f"model.layers.{i}.mlp.weight", torch.randn(256, 64, generator=gen)) for i in range(4)]
    for s in range(1, step + 1):
        named[s % 4][1].view(-1)[: 20 * s] += 0.5
    return named


def as_bf16(named: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: tensor.to(torch.bfloat16) for name, tensor in named}


def held(puller: VersionPuller) -> dict[str, torch.Tensor]:
    version = puller.held_weights()
    assert version is not None
    return {name: tensor.clone() for name, tensor in version[1]}


@pytest.mark.parametrize("use_delta", [True, False])
def test_a_late_worker_gets_the_latest_whole_then_deltas_then_whole_when_far_behind(tmp_path: Path,
                                                                                     use_delta: bool) -> None:
    publisher = WeightPublisher(NoMembers(), bucket_bytes=32 << 10, delta=use_delta)
    server = publisher.late = VersionServer(tmp_path / "attach", bind="127.0.0.1")
    assert stat.S_IMODE(os.stat(server.door.register).st_mode) == 0o600  # it holds the key
    puller = VersionPuller(tmp_path / "attach")
    assert puller.pull() is None  # nothing published: the folder's weights are current
    total = sum(t.numel() * 2 for _, t in weights(0))
    for version in (1, 2, 3):
        publisher.publish(weights(version), version, dtype=torch.bfloat16)
    first = puller.pull()  # joins at version 3: whole
    assert first is not None and first.version == 3 and first.num_buckets == 4
    assert puller.bytes_received == total
    assert all(torch.equal(held(puller)[n], t) for n, t in as_bf16(weights(3)).items())

    publisher.publish(weights(4), 4, dtype=torch.bfloat16)
    second = puller.pull(4)
    assert second is not None and second.version == 4
    changed = [name for bucket in second for name, _ in bucket]
    if use_delta:  # only layer 0 changed (its bucket), and only its changed words came
        assert changed == ["model.layers.0.mlp.weight"] and puller.bytes_received < total // 40
    else:
        assert len(changed) == 4 and puller.bytes_received == total
    assert all(torch.equal(held(puller)[n], t) for n, t in as_bf16(weights(4)).items())

    for version in (5, 6):
        publisher.publish(weights(version), version, dtype=torch.bfloat16)
    third = puller.pull(6)  # two versions behind: whole again
    assert third is not None and third.num_buckets == 4 and puller.bytes_received == total
    assert all(torch.equal(held(puller)[n], t) for n, t in as_bf16(weights(6)).items())

    with pytest.raises(WeightStreamError, match="version 5 was wanted; the publisher holds version 6"):
        puller.pull(5)
    puller.close()
    publisher.finish()


def test_a_peer_without_the_key_is_refused(tmp_path: Path) -> None:
    from multiprocessing.connection import Client

    server = VersionServer(tmp_path / "attach", bind="127.0.0.1")
    address = ("127.0.0.1", server.door.port)
    with pytest.raises(Exception, match="digest|authentication|AuthenticationError"):
        Client(address, authkey=b"not the key")
    server.close()
