"""How weight bytes get from the trainer to the engines: one class per transport behind one interface.

A transport is a broadcast group with one source (trainer rank 0) and any number of receivers (the
engine ranks). It moves three things, in the same order on every member: a fixed-size header per
version, the manifest when the layout changes, and messages (flat uint8 byte ranges) that the source
sends from its memory and every receiver lands in its own. The publisher and receiver in
`sfhpc.weights.publisher` only talk to this interface; `connect` (collective over the weight-broadcast
communicator) builds the transport a recipe's ``engine.weight_transport`` names.

`MPITransport`: host memory and non-blocking ``MPI_Ibcast`` over a communicator that holds exactly the
trainer's source rank and the engine ranks (the runtime's weight-broadcast group) and carries nothing
else: receivers post the next header as soon as they have posted a version's last bucket, and MPI
matches collectives on one communicator in posting order, so any other collective on it would be matched
against that header. Headers and messages are non-blocking on every member because MPI never matches a
blocking collective with a non-blocking one, and a rollout rank must be able to wait for a version
without blocking its event loop.

`TorchTransport`: the header and manifest stay on MPI (small, and the group exists), the messages go over
a `torch.distributed` group (`sfhpc.weights.group`: NCCL between GPUs, gloo on CPUs) from buffers in the
backend's device memory. Its receivers are either the ranks themselves or, where an engine can join the
group (vLLM: a worker extension, `sfhpc.engine.vllm_worker`), the engine's own processes, which receive
each bucket into their device memory and load it there: the bytes are not copied to the rank's host
memory nor pickled on their way to the engine.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from sfhpc.weights import group as weight_group
from sfhpc.weights.manifest import MAX_MESSAGE, WeightManifest

TransportChoice = Literal["auto", "mpi", "torch"]
log = logging.getLogger("sfhpc")


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

    @property
    def engine_receives(self) -> bool:
        """True on a receiver whose engine's own processes are the members that receive the messages: the
        rank takes the header and manifest, and hands the version to its engine (`RolloutEngine.receive_weights`)."""
        return False

    def post_header(self, header: torch.Tensor) -> Transfer:
        """Start broadcasting a version's header (a small host tensor) from the source."""
        return self.post([self.wire(header)])

    def close(self) -> None:
        """Release what the transport holds once the stream has ended (every transfer complete); idempotent.
        MPI's communicators belong to the run's layout (`sfhpc.runtime.comm_layout`), so by default: nothing."""
        return None

    @abc.abstractmethod
    def wire(self, tensor: torch.Tensor, start: int = 0, nbytes: int | None = None) -> Any:
        """This transport's handle to bytes ``[start, start + nbytes)`` of a contiguous `tensor` in memory
        `allocate` gives (any dtype; default: all of it), for `post`. Made once and reused where the memory is
        persistent; the handle does not keep the tensor alive."""

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


class _Works(Transfer):
    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def test(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def wait(self) -> None:
        for work in self._works:
            work.wait()


class TorchTransport(WeightTransport):
    """Messages over a `torch.distributed` process group of the source and the receiving members, the
    header and manifest over `control` (MPI). Build it with `connect`.

    `process_group` is None on a rank whose engine joined the group in its place (`engine_receives`): that
    rank posts headers and reads manifests only."""

    def __init__(self, control: MPITransport, process_group: Any, device: torch.device, *,
                 engine_receives: bool = False, store: Any = None) -> None:
        self.control = control
        self.process_group = process_group
        self.device = device
        self._engine_receives = engine_receives
        self._store = store  # the source keeps the members' meeting point open while the group lives

    @property
    def is_source(self) -> bool:
        return self.control.is_source

    @property
    def size(self) -> int:
        return self.control.size

    @property
    def engine_receives(self) -> bool:
        return self._engine_receives

    def share_manifest(self, manifest: WeightManifest | None) -> WeightManifest | None:
        return self.control.share_manifest(manifest)

    def post_header(self, header: torch.Tensor) -> Transfer:
        return self.control.post([self.control.wire(header)])

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def wire(self, tensor: torch.Tensor, start: int = 0, nbytes: int | None = None) -> Any:
        size = tensor.numel() * tensor.element_size()
        nbytes = size - start if nbytes is None else nbytes
        if not tensor.is_contiguous() or not 0 <= start <= start + nbytes <= size:
            raise ValueError("TorchTransport sends byte ranges of contiguous tensors")
        return tensor.reshape(-1).view(torch.uint8)[start:start + nbytes]

    def close(self) -> None:
        # Drop the process group here, in the thread that ends the stream: its destructor joins gloo's worker
        # threads. Left to the interpreter's exit, a worker thread that releases a tensor's Python object
        # while the interpreter finalises is ended by pthread_exit, and the process aborts ("terminate called
        # without an active exception", seen under load in the broadcast test).
        self.process_group = None
        self._store = None

    def post(self, messages: Sequence[Any]) -> Transfer:
        if self.process_group is None:
            raise RuntimeError("no weight group on this rank: its engine receives the weights itself, or the "
                               "stream has ended")
        return _Works([weight_group.broadcast(self.process_group, message) for message in messages])


def connect(comm: Any, choice: TransportChoice = "auto", *, root: int = 0, engine_members: int = 0,
            join_engine: Callable[[weight_group.WeightGroup, int], None] | None = None,
            poll_s: float = 0.02) -> WeightTransport:
    """The transport `choice` names, on every member of the weight-broadcast communicator `comm` (collective).

    ``auto`` is ``torch`` where the source has CUDA, else ``mpi``. A receiver whose engine can join a
    torch group passes `engine_members` (the engine's processes that join: its tensor-parallel workers) and
    `join_engine(group, first_member)`, which returns once they have joined; other receivers join
    themselves. The waits sleep between tests: the source arrives here long before the engines have started.
    """
    arrived = comm.Ibarrier()  # every member is here before anything blocks
    while not arrived.Test():
        time.sleep(poll_s)
    source = comm.Get_rank() == root
    resolved = ("torch" if torch.cuda.is_available() else "mpi") if choice == "auto" else choice
    resolved = comm.bcast(resolved if source else None, root=root)
    control = MPITransport(comm, root)
    if resolved == "mpi":
        if source:
            log.info("weights travel over MPI (host memory), %d receiving ranks", comm.Get_size() - 1)
        return control
    members = comm.allgather(1 if source or join_engine is None else max(1, engine_members))
    order = [root, *(r for r in range(comm.Get_size()) if r != root)]  # the source is member 0
    first = sum(members[r] for r in order[:order.index(comm.Get_rank())])
    opened = weight_group.open_group(sum(members)) if source else None
    group = weight_group.WeightGroup.from_json(comm.bcast(opened[0].to_json() if opened else None, root=root))
    log.info("weights travel over torch.distributed (%s), %d members; %s", group.backend, group.size,
             "this rank sends as member 0" if source else
             f"this rank's engine receives as members {first}-{first + members[comm.Get_rank()] - 1}"
             if join_engine is not None else f"this rank receives as member {first}")
    if opened is not None:
        return TorchTransport(control, weight_group.join(group, 0, store=opened[1]), group.device, store=opened[1])
    if join_engine is not None:
        join_engine(group, first)
        return TorchTransport(control, None, group.device, engine_receives=True)
    return TorchTransport(control, weight_group.join(group, first), group.device)
