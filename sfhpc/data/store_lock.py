"""The store's writer lock: a lock file beside the store, so no two processes ever write one store.

The lock cannot be on the HDF5 file itself: SWMR readers take a shared lock on that file. The lock file
(``RUN.h5.lock``) is empty and kept; the kernel drops the lock when its process dies, so a killed writer
never blocks its restart.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

from sfhpc.data.errors import StoreError

# What flock answers on a file system that has no locks (NFS mounted 'nolock', Lustre without 'flock'), as
# opposed to EWOULDBLOCK / EAGAIN: another process holds the lock.
NO_FLOCK = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL})


def lock_path(path: Path) -> Path:
    """The writer's lock file next to the store (empty; held while a writer has the store open)."""
    return path.with_name(path.name + ".lock")


def take_writer_lock(path: Path) -> int:
    """Hold the writer lock of the store at `path`; returns the lock's file descriptor. Raises StoreError
    when another process holds it."""
    lock = lock_path(path)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise StoreError(f"{path}: cannot create its writer lock {lock} ({exc.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in NO_FLOCK:
            raise StoreError(
                f"{path}: its file system does not support file locks (flock: {exc.strerror}), which keep two "
                f"runs from writing one store; have it mounted with locks (NFS: without 'nolock'; Lustre: "
                f"'flock', or 'localflock', enough since one node writes the store), or set the recipe's "
                f"output_dir to a file system that has them (a node-local disk for a one-node run)") from None
        raise StoreError(f"{path}: another process is writing this store (it holds {lock}); "
                         "a store has one writer: stop that run first") from None
    return fd


def release_writer_lock(fd: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
