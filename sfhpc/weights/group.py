"""A `torch.distributed` process group for the weight broadcast, built beside any other torch group.

The trainer's source rank and the receivers (ranks, or the processes of an engine such as vLLM's workers)
meet at a TCP store the source opens; each member then builds the group object directly
(``ProcessGroupNCCL`` between GPUs, ``ProcessGroupGloo`` on CPUs) instead of through
``torch.distributed.init_process_group``, because a vLLM worker already holds the process's default group
for its own tensor parallelism, and one process may hold only one default group.

The source picks the backend from its own device: NCCL when CUDA is present, gloo otherwise (the same code
runs on CPU machines, which is how the tests run it). Every member puts its buffers on the backend's device.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
from typing import Any

import torch

STORE_PREFIX = "sfhpc-weights"
HOST_VARIABLE = "SFHPC_WEIGHT_GROUP_HOST"  # the source's address as other nodes reach it (default: its hostname)


@dataclasses.dataclass(frozen=True)
class WeightGroup:
    """Where the members meet and what they build: the source's store, the number of members and the backend."""

    host: str
    port: int
    size: int
    backend: str  # "nccl" or "gloo"
    timeout_s: float = 300.0

    @property
    def device(self) -> torch.device:
        """Where a member's buffers live: a GPU of the member's own under NCCL, host memory under gloo."""
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WeightGroup:
        return cls(**data)


def source_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def open_group(size: int, *, timeout_s: float = 300.0) -> tuple[WeightGroup, Any]:
    """On the source: open the store the members meet at (a free port); returns the group's address and the
    store, which the source passes to `join` as member 0 and keeps while the group lives.

    The store listens on the address the members connect to (`HOST_VARIABLE`, else this node's host name, as
    resolved here), not on every interface. torch's TCPStore binds every interface whatever host name it is
    given; it listens on one address only when handed a socket bound there (``master_listen_fd``), which is
    what this does. A host name that resolves here to a loopback address although it is no loopback name (a
    name mapped to 127.0.1.1 in /etc/hosts, as Debian does) says nothing about the address other nodes reach
    this one at: then the store listens on every interface, as before; set `HOST_VARIABLE` to pin it."""
    timeout = datetime.timedelta(seconds=timeout_s)
    host = os.environ.get(HOST_VARIABLE) or socket.gethostname()
    listening = listening_socket(host, pinned=bool(os.environ.get(HOST_VARIABLE)))
    if listening is None:
        store = torch.distributed.TCPStore("0.0.0.0", 0, size, is_master=True, wait_for_workers=False,
                                           timeout=timeout)
        return WeightGroup(host, store.port, size, source_backend(), timeout_s), store
    port = listening.getsockname()[1]
    # The store owns the socket from here (libuv closes it with the store).
    store = torch.distributed.TCPStore(host, port, size, is_master=True, wait_for_workers=False, timeout=timeout,
                                       master_listen_fd=listening.detach(), use_libuv=True)
    return WeightGroup(host, port, size, source_backend(), timeout_s), store


def listening_socket(host: str, *, pinned: bool = False) -> socket.socket | None:
    """A socket listening on a free port of the address `host` resolves to here; None where that address does not
    tell the interface the members use (see `open_group`), or `host` does not resolve. `pinned`: the address
    was named for this purpose (`HOST_VARIABLE`), loopback included."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except (OSError, IndexError):
        return None
    ip = str(address[0])
    loopback = ip.startswith("127.") or ip == "::1"
    if loopback and not pinned and host not in ("localhost", "127.0.0.1", "::1"):
        return None
    listening = socket.socket(family, kind, proto)
    try:
        listening.bind((ip, 0, *address[2:]))
        listening.listen(512)
    except OSError:
        listening.close()
        return None
    return listening


def join(group: WeightGroup, member: int, store: Any = None) -> Any:
    """Build this member's process group object; returns once every member has joined (collective).
    `store`: the source's own (member 0); other members connect to it."""
    timeout = datetime.timedelta(seconds=group.timeout_s)
    if store is None:
        store = torch.distributed.TCPStore(group.host, group.port, group.size, is_master=False, timeout=timeout)
    prefixed = torch.distributed.PrefixStore(STORE_PREFIX, store)
    if group.backend == "nccl":
        nccl = torch.distributed.ProcessGroupNCCL  # absent from CPU builds of torch, never reached there
        return nccl(prefixed, member, group.size, nccl.Options())
    return torch.distributed.ProcessGroupGloo(prefixed, member, group.size, timeout)


def broadcast(process_group: Any, tensor: torch.Tensor, root: int = 0) -> Any:
    """Start broadcasting `tensor` from member `root`; returns the work to `wait` for (or test)."""
    options = torch.distributed.BroadcastOptions()
    options.rootRank = root
    return process_group.broadcast([tensor], options)
