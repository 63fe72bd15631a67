"""How weight bytes get from the trainer to the engines: one class per transport behind one interface.

A transport is a broadcast group with one source (trainer rank 0) and any number of receivers (the
engine ranks). It moves two things: the small manifest of a version (once), then the buckets, sent from
the source's own tensors and received into one flat uint8 buffer per bucket. The publisher and receiver
in `sfhpc.weights.publisher` only talk to this interface.

`MPITransport` is the one implemented: host memory and ``MPI_Bcast`` over a communicator that holds
exactly the trainer's source rank and the engine ranks (the runtime's weight-broadcast group).

The seam for GPUs: an ``NcclTransport`` would keep the manifest on MPI (it is small and the group
already exists) but `allocate` buffers in device memory, pack each bucket on the device (`manifest.pack`)
and broadcast it with ``torch.distributed.broadcast`` on a NCCL group of the same ranks (or hand it to
vLLM's weight-transfer engine), so the bytes never touch the host. Nothing above this module changes.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import torch

from sfhpc.weights.manifest import TensorMeta, WeightManifest, as_bytes

MAX_MESSAGE = 1 << 30  # bytes per MPI call: Open MPI 4 counts are C ints, so stay well below 2 GiB


class WeightTransport(abc.ABC):
    """A one-to-many broadcast of manifests and buckets. Every member calls every method in the same order
    (they are collective)."""

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
        """The source passes its manifest (None: no more versions); every member gets it back."""

    @abc.abstractmethod
    def allocate(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer this transport can receive a bucket into."""

    @abc.abstractmethod
    def broadcast_bucket(self, metas: Sequence[TensorMeta], tensors: Sequence[torch.Tensor] | None,
                         buffer: torch.Tensor | None) -> None:
        """Move one bucket. The source passes the bucket's `tensors` (one per meta; it may send them from
        where they lie); every receiver passes a `buffer` of the bucket's size and finds each tensor's
        bytes at its meta's offset."""


class MPITransport(WeightTransport):
    """``MPI_Bcast`` from `root` of an mpi4py communicator, one call per bucket, with no packing copy.

    The source describes the bucket's tensors, where they lie in its memory, with an MPI derived datatype
    (``hindexed`` over absolute addresses) and receivers with one over their buffer's offsets: Open MPI
    then reads each tensor while it sends instead of the source first copying them into one buffer. On
    a loaded 2-core machine that copy alone took longer than the broadcast.
    """

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
        # MPI's single-copy receive measurably faster than into torch-allocated memory.
        import numpy as np

        return torch.from_numpy(np.empty(nbytes, dtype=np.uint8))

    def broadcast_bucket(self, metas: Sequence[TensorMeta], tensors: Sequence[torch.Tensor] | None,
                         buffer: torch.Tensor | None) -> None:
        from mpi4py import MPI

        keep = [i for i, m in enumerate(metas) if m.nbytes]  # empty tensors have no bytes (nor an address)
        if not keep:
            return
        if self.is_source:
            if tensors is None:
                raise ValueError("the source broadcasts tensors")
            parts = [as_bytes(tensors[i]) for i in keep]  # contiguous views (a copy only if not contiguous)
            if len(parts) == 1:
                self._bcast_contiguous(parts[0])
                return
            lengths, displacements, base = [p.numel() for p in parts], [p.data_ptr() for p in parts], MPI.BOTTOM
        else:
            if buffer is None or buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
                raise ValueError("MPITransport receives into a flat, contiguous uint8 host tensor")
            if len(keep) == 1:
                m = metas[keep[0]]
                self._bcast_contiguous(buffer[m.offset:m.offset + m.nbytes])
                return
            lengths, displacements = [metas[i].nbytes for i in keep], [metas[i].offset for i in keep]
            base = buffer.numpy()
        if sum(lengths) > MAX_MESSAGE:
            raise ValueError(f"a bucket of several tensors holds at most {MAX_MESSAGE} bytes over MPI")
        datatype = MPI.BYTE.Create_hindexed(lengths, displacements).Commit()
        try:
            self.comm.Bcast([base, 1, datatype], root=self.root)
        finally:
            datatype.Free()

    def _bcast_contiguous(self, data: torch.Tensor) -> None:
        array = data.numpy()  # shares memory: MPI reads/writes the tensor itself
        for start in range(0, len(array), MAX_MESSAGE):
            self.comm.Bcast(array[start:start + MAX_MESSAGE], root=self.root)
