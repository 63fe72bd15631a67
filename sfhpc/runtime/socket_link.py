"""A link to a process outside the run's MPI world, which looks to sfhpc like the MPI communicator it replaces.

Rollout workers of another Slurm job (`sfhpc attach`) are not ranks of the run's world: MPI cannot add a process
to a running world, and a world loses every rank when one dies. Each such worker holds one TCP connection to the
controller instead, authenticated with the run's attach key (`multiprocessing.connection`: an HMAC challenge both
ways before anything is unpickled, so only a holder of the key can send a message), and that connection carries
everything a rollout rank's world and manager link carry. `SocketLink` offers the part of an mpi4py communicator
that sfhpc's messages use (``send``, ``recv``, ``iprobe``/``Iprobe`` with a tag, ``Get_rank``): the command loop
(`sfhpc.rl.rank_commands`) and the trajectory manager's client (`sfhpc.data.service`) run over it unchanged.

Messages are ``(tag, object)`` pairs; a reader thread sorts them into one queue per tag, so those of one tag
arrive in order and a probe never blocks. A connection that breaks (the worker's job ended, its node died) closes
the link: every later probe, receive or send raises `LinkClosed`, which the other side handles as the worker
leaving without a word. `multiprocessing.connection` rather than an HTTP service: messages are the same pickled
dataclasses MPI carries, both ends are sfhpc, and the handshake is the library's.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from multiprocessing.connection import Connection
from typing import Any

from sfhpc.errors import SfhpcError

log = logging.getLogger("sfhpc")
ANY = -1  # a source or tag that matches any (mpi4py's ANY_SOURCE and ANY_TAG are -1 and -1 as well)


class LinkClosed(SfhpcError):
    """The process at the other end of a `SocketLink` is gone (or closed the link)."""


class SocketLink:
    """One end of a connection to one peer; `rank` is this end's rank, `peer` the other end's."""

    def __init__(self, connection: Connection, *, rank: int, peer: int, name: str = "") -> None:
        self.rank, self.peer, self.name = rank, peer, name or f"link to {peer}"
        self._connection = connection
        self._inbox: dict[int, collections.deque[Any]] = collections.defaultdict(collections.deque)
        self._arrived = threading.Condition()
        self._sending = threading.Lock()
        self.closed_because: str | None = None  # why the link closed (None while it is open)
        self._reader = threading.Thread(target=self._read, name=f"sfhpc-{self.name}", daemon=True)
        self._reader.start()

    @property
    def closed(self) -> bool:
        return self.closed_because is not None

    def _read(self) -> None:
        reason = "the connection ended"
        try:
            while True:
                tag, message = self._connection.recv()
                with self._arrived:
                    self._inbox[tag].append(message)
                    self._arrived.notify_all()
        except (EOFError, OSError) as exc:
            reason = f"the connection ended ({type(exc).__name__}{': ' + str(exc) if str(exc) else ''})"
        except Exception as exc:  # noqa: BLE001 (a message that does not unpickle ends the link, visibly)
            reason = f"a message could not be read ({type(exc).__name__}: {exc})"
        finally:
            self._close(reason)

    def _close(self, reason: str) -> None:
        with self._arrived:
            if self.closed_because is None:
                self.closed_because = reason
            self._arrived.notify_all()

    def close(self) -> None:
        """Close this end (the peer's reads then end); idempotent."""
        self._close("closed here")
        with contextlib.suppress(OSError):
            self._connection.close()

    def _check_peer(self, other: int | None) -> None:
        if other not in (None, ANY, self.peer):
            raise ValueError(f"{self.name}: rank {other} is not this link's peer (rank {self.peer})")

    # -- the communicator's part -----------------------------------------------------------------------
    def Get_rank(self) -> int:  # noqa: N802 (mpi4py's name)
        return self.rank

    def send(self, message: Any, dest: int, tag: int = 0) -> None:
        self._check_peer(dest)
        with self._sending:
            if self.closed:
                raise LinkClosed(f"{self.name}: {self.closed_because}")
            try:
                self._connection.send((tag, message))
            except (OSError, ValueError) as exc:
                self._close(f"a send failed ({type(exc).__name__}: {exc})")
                raise LinkClosed(f"{self.name}: {self.closed_because}") from exc

    def iprobe(self, source: int | None = ANY, tag: int = ANY, status: Any = None) -> bool:
        """True if a message with `tag` waits; raises `LinkClosed` once the link closed and none waits."""
        self._check_peer(source)
        with self._arrived:
            if self._inbox[tag]:
                if status is not None:
                    status.Set_source(self.peer)
                return True
            if self.closed:
                raise LinkClosed(f"{self.name}: {self.closed_because}")
        return False

    Iprobe = iprobe  # mpi4py spells the probe that fills a status with a capital

    def recv(self, source: int | None = ANY, tag: int = ANY, timeout: float | None = None) -> Any:
        """The next message with `tag` (waits for it)."""
        self._check_peer(source)
        with self._arrived:
            if not self._arrived.wait_for(lambda: self._inbox[tag] or self.closed, timeout):
                raise TimeoutError(f"{self.name}: no message with tag {tag:#x} within {timeout} s")
            if self._inbox[tag]:
                return self._inbox[tag].popleft()
            raise LinkClosed(f"{self.name}: {self.closed_because}")
