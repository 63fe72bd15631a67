"""How weight bytes get from the trainer to the engines: one class per transport behind one interface.

A transport is a broadcast group with one source (trainer rank 0) and any number of receivers (the
engine ranks). It moves three things, in the same order on every member: a fixed-size header per
version, the manifest when the layout changes, and messages (flat uint8 byte ranges) that the source
sends from its memory and every receiver lands in its own. The publisher and receiver in
`sfhpc.weights.publisher` only talk to this interface.

`MPITransport` is the one implemented: host memory and non-blocking ``MPI_Ibcast`` over a communicator
that holds exactly the trainer's source rank and the engine ranks (the runtime's weight-broadcast group)
and carries nothing else: receivers post the next header as soon as they have posted a version's last
bucket, and MPI matches collectives on one communicator in posting order, so any other collective on
it would be matched against that header.
Headers and messages are non-blocking on every member because MPI never matches a blocking collective
with a non-blocking one, and a rollout rank must be able to wait for a version without blocking its
event loop.

The seam for GPUs: an ``NcclTransport`` would keep the header and manifest on MPI (small, and the group
already exists) but `allocate` buffers in device memory, and `post` each message with
``torch.distributed.broadcast(async_op=True)`` on a NCCL group of the same ranks (or hand it to vLLM's
weight-transfer engine), so the bytes never touch the host. Nothing above this module changes.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import torch

from sfhpc.weights.manifest import MAX_MESSAGE, WeightManifest


class Transfer(abc.ABC):
    """Messages on their way; every member must `wait` for them (or see `test` say True)."""

    @abc.abstractmethod
    def test(self) -> bool:
        """Let the transfer progress; True once it is complete on this member."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until the transfer is complete on this member."""


class WeightTransport(abc.ABC):
    """A one-to-many broadcast of manifests and messages. Every member calls every method in the same
    order (they are collective)."""

    @property
    @abc.abstractmethod
    def is_source(self) -> bool:
        """True on the one member that sends."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """Members of the group, the source included."""

    @abc.abstractmethod
    def share_manifest(self, manifest: WeightManifest | None) -> WeightManifest | None:
        """The source passes its manifest; every member gets it back (blocking, and rare: once per layout)."""

    @abc.abstractmethod
    def allocate(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer this transport sends from and receives into at full speed."""

    def wait_all(self, transfers: Sequence[Transfer]) -> None:
        """Block until every transfer is complete (a transport may do it in one call)."""
        for transfer in transfers:
            transfer.wait()

    @abc.abstractmethod
    def wire(self, tensor: torch.Tensor, start: int = 0, nbytes: int | None = None) -> Any:
        """This transport's handle to bytes ``[start, start + nbytes)`` of a contiguous host `tensor` (any
        dtype; default: all of it), for `post`. Made once and reused where the memory is persistent; the
        handle does not keep the tensor alive."""

    @abc.abstractmethod
    def post(self, messages: Sequence[Any]) -> Transfer:
        """Start broadcasting each message (a `wire` handle), in order: the source sends from it and every
        receiver fills its own (same lengths on every member). The memory must stay alive and, on the
        source, unchanged until the transfer is complete."""


class _Requests(Transfer):
    def __init__(self, requests: list[Any]) -> None:
        self._requests = requests

    def test(self) -> bool:
        from mpi4py import MPI

        return bool(MPI.Request.Testall(self._requests))

    def wait(self) -> None:
        from mpi4py import MPI

        MPI.Request.Waitall(self._requests)


class MPITransport(WeightTransport):
    """``MPI_Ibcast`` from `root` of an mpi4py communicator, one call per message, straight from and into
    the tensors' memory (Open MPI moves large contiguous messages between ranks of a node with a single
    copy, which a derived datatype over scattered tensors would lose)."""

    def __init__(self, comm: Any, root: int = 0) -> None:
        if not 0 <= root < comm.Get_size():
            raise ValueError(f"root {root} is not a rank of a communicator of size {comm.Get_size()}")
        self.comm = comm
        self.root = root

    @property
    def is_source(self) -> bool:
        return self.comm.Get_rank() == self.root

    @property
    def size(self) -> int:
        return self.comm.Get_size()

    def share_manifest(self, manifest: WeightManifest | None) -> WeightManifest | None:
        return self.comm.bcast(manifest if self.is_source else None, root=self.root)

    def allocate(self, nbytes: int) -> torch.Tensor:
        # numpy's allocator asks for transparent huge pages on large arrays; fewer pages to map made
        # MPI's single-copy transfers measurably faster than from or into torch-allocated memory.
        import numpy as np

        buffer = np.empty(nbytes, dtype=np.uint8)
        buffer.fill(0)  # fault the pages in now, once, rather than during the first transfer
        return torch.from_numpy(buffer)

    def wire(self, tensor: torch.Tensor, start: int = 0, nbytes: int | None = None) -> Any:
        from mpi4py import MPI

        size = tensor.numel() * tensor.element_size()
        nbytes = size - start if nbytes is None else nbytes
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or not 0 <= start <= start + nbytes <= size:
            raise ValueError("MPITransport sends byte ranges of contiguous host tensors")
        if nbytes > MAX_MESSAGE:
            raise ValueError(f"a message holds at most {MAX_MESSAGE} bytes over MPI, found {nbytes}")
        # A raw address: no numpy view nor torch op per message (they cost more than the message itself on
        # small sets), and MPI reads (source) or writes (receivers) the tensor's own memory.
        return MPI.buffer.fromaddress(tensor.data_ptr() + start, nbytes)

    def wait_all(self, transfers: Sequence[Transfer]) -> None:
        from mpi4py import MPI

        # One MPI_Waitall: every call into MPI may yield the core when oversubscribed, which costs more
        # than a small message.
        MPI.Request.Waitall([r for t in transfers for r in t._requests])  # type: ignore[attr-defined]

    def post(self, messages: Sequence[Any]) -> Transfer:
        return _Requests([self.comm.Ibcast(message, root=self.root) for message in messages])
