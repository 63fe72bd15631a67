"""How trainer ranks find each other for data parallelism and sharding (torch.distributed: gloo, or NCCL on GPUs).

The runtime already has an MPI communicator of the trainer ranks; torch.distributed needs its own
rendezvous. `DistSpec.from_mpi` uses the communicator only to agree on one: rank 0 picks a free TCP port
on its host and broadcasts the address. `DistSpec.from_env` reads the usual torchrun variables instead.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from typing import Any

from sfhpc.trainer.errors import TrainerError

ADDR_VAR = "SFHPC_TRAINER_ADDR"  # the address other trainer ranks reach rank 0 at (default: its hostname)


@dataclasses.dataclass(frozen=True)
class DistSpec:
    """This rank's place among the trainer ranks and where they meet (``tcp://host:port``)."""

    rank: int
    world_size: int
    init_method: str = ""
    backend: str = "gloo"
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise TrainerError(f"trainer rank {self.rank} is outside a world of {self.world_size}")
        if self.world_size > 1 and not self.init_method:
            raise TrainerError("several trainer ranks need a rendezvous address (init_method tcp://host:port)")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def single(cls) -> DistSpec:
        return cls(rank=0, world_size=1)

    @classmethod
    def from_mpi(cls, comm: Any, *, host: str | None = None, backend: str = "gloo") -> DistSpec:
        """Rank and size of `comm` (an mpi4py communicator of the trainer ranks); rank 0 chooses the address.
        `backend`: gloo on CPUs, nccl where the trainers have GPUs."""
        rank, size = comm.Get_rank(), comm.Get_size()
        if size == 1:
            return cls(rank=0, world_size=1, backend=backend)
        address = None
        if rank == 0:
            host = host or os.environ.get(ADDR_VAR) or socket.gethostname()
            address = f"tcp://{host}:{_free_port(host)}"
        return cls(rank=rank, world_size=size, init_method=comm.bcast(address, root=0), backend=backend)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DistSpec:
        """From ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (torchrun's variables)."""
        env = os.environ if env is None else env
        try:
            rank, size = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
        except ValueError:
            raise TrainerError("RANK and WORLD_SIZE must be integers") from None
        if size == 1:
            return cls.single()
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise TrainerError(f"WORLD_SIZE is {size}: set MASTER_ADDR and MASTER_PORT to trainer rank 0's address")
        return cls(rank=rank, world_size=size, init_method=f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}")

    def init_process_group(self, *, group_of_one: bool = False) -> None:
        """Start torch.distributed's default group for this spec (no-op when already up, and for one rank
        unless `group_of_one`: sharding a single rank's model still needs a group, of that rank alone)."""
        import datetime

        import torch.distributed as dist

        if dist.is_initialized():
            return
        if not self.distributed:
            if group_of_one:
                dist.init_process_group(backend=self.backend, store=dist.HashStore(), rank=0, world_size=1)
            return
        dist.init_process_group(backend=self.backend, init_method=self.init_method, rank=self.rank,
                                world_size=self.world_size, timeout=datetime.timedelta(seconds=self.timeout_s))


def _free_port(host: str) -> int:
    # Bind port 0 to let the OS choose, then release it for torch's store. Another process could take it
    # in between; on a job's own nodes that window is harmless in practice.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, 0))
        except OSError:
            s.bind(("", 0))
        return int(s.getsockname()[1])
