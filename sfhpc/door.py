"""A door into a process of a run for processes outside its MPI world: a TCP listener with a key of its own.

The run's controller (for rollout workers of other jobs, `sfhpc.rl.attached`) and its first trainer (for the
weights those workers pull, `sfhpc.weights.version_server`) each open one. `Door` listens on an ephemeral port
and writes its address and key into the run folder's register (`sfhpc.rundir.write_register`: mode 0600, whole or
not at all); `knock` is the other side: it waits for the register, connects and authenticates.
`multiprocessing.connection` does the handshake (an HMAC challenge both ways before anything is unpickled), so
only a holder of the key, the run's user, gets a connection; a peer without it is refused and the door stays open.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

from sfhpc.errors import SfhpcError
from sfhpc.rundir import write_register

log = logging.getLogger("sfhpc")


class Door:
    """Listens for authenticated connections; each goes to `on_connection` (on the door's thread: hand a long
    conversation to a thread of its own). Registered as ``<register>/<name>.json``."""

    def __init__(self, register: Path, name: str, on_connection: Callable[[Connection], None], *,
                 bind: str = "0.0.0.0") -> None:
        self.name = name
        self.key = secrets.token_bytes(32)
        self._listener = Listener((bind, 0), authkey=self.key)
        self.port = self._listener.address[1]
        host = socket.gethostname() if bind in ("0.0.0.0", "") else bind
        self.register = write_register(register, name, {"address": [host, self.port], "key": self.key.hex(),
                                                        "node": socket.gethostname(), "pid": os.getpid()})
        self._on_connection = on_connection
        self._closed = False
        threading.Thread(target=self._accept, name=f"sfhpc-door-{name}", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                connection = self._listener.accept()
            except OSError:
                return  # closed
            except Exception as exc:  # noqa: BLE001 (a peer without the key: refused, the door stays open)
                log.warning("%s: a connection was refused (%s: %s)", self.name, type(exc).__name__, exc)
                continue
            try:
                self._on_connection(connection)
            except Exception as exc:  # noqa: BLE001 (one peer's failure is its own)
                log.warning("%s: a connection failed (%s: %s)", self.name, type(exc).__name__, exc)
                connection.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()


def refuse(register: Path, name: str, why: str) -> None:
    """Say in the register that this door is not open, and why (`knock` raises it)."""
    write_register(register, name, {"refused": why})


def knock(register: Path, name: str, *, timeout_s: float, what: str) -> Connection:
    """Connect to the door registered as `name` in `register`, waiting up to `timeout_s` for it to be registered;
    `what` names it in the one-line errors."""
    path = register / f"{name}.json"
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        if time.monotonic() > deadline:
            raise SfhpcError(f"no {what} is registered in {register} after {timeout_s:g} s: is the run running? "
                             "(sfhpc status)")
        time.sleep(0.5)
    record = json.loads(path.read_text())
    if "refused" in record:
        raise SfhpcError(f"the run takes no rollout workers of other jobs: {record['refused']}")
    host, port = record["address"]
    try:
        return Client((host, port), authkey=bytes.fromhex(record["key"]))
    except OSError as exc:
        raise SfhpcError(f"the {what} at {host}:{port} cannot be reached ({exc}): has the run ended, or does a "
                         "firewall stand between the nodes? (docs/cluster-admins.md)") from exc
