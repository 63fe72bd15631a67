"""A full disk while the store writes is one line naming the store and "No space left on device" (`StoreFull`,
an `SfhpcError`), never HDF5's raw RuntimeError; what was not written stays buffered, and a flush once there
is room again commits it. The disk is faked: h5py's writes fail as HDF5 makes them fail on a full file system
(a RuntimeError quoting errno 28 from a dataset flush, or an OSError with ENOSPC), which is what a full tmpfs
produced when this was written (tests/runtime/test_faults_on_ranks.py fills a real one where it may mount).
A file system without flock gets a lock error that says so and what to do."""

from __future__ import annotations

import errno
import fcntl
from pathlib import Path

import h5py
import pytest

from sfhpc.data import store_lock
from sfhpc.data.errors import SfhpcError, StoreError, StoreFull
from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.store import TrajectoryStore, open_store
from sfhpc.engine.tokenizer import END, ByteTokenizer

# The text HDF5 gives when a write meets a full disk (seen on a 2 MiB tmpfs), minus the address and the time.
HDF5_FULL = ("Unable to flush dataset (file write failed: time = Fri Dec  4 21:39:01 2026\n, filename = '{path}', "
             "file descriptor = 4, errno = 28, error message = 'No space left on device', buf = 0x55f7, total write "
             "size = 2512, bytes this sub-write = 2512, offset = 2097152)")


def add_one(manager: TrajectoryManager, name: str) -> None:
    tokenizer = ByteTokenizer()
    tid = manager.start(tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]), task="t", group=name,
                        trajectory_id=name)
    reply = tokenizer.encode("hello") + [END]
    manager.add_generated(tid, reply, [-0.5] * len(reply), 1, engine="e", finish_reason="stop")
    manager.finish(tid, reward=1.0)


@pytest.mark.parametrize("fault", ["hdf5-runtime-error", "oserror-enospc"])
def test_a_full_disk_is_one_line_and_the_records_wait_for_room(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               fault: str) -> None:
    path = tmp_path / "trajectories.h5"
    store = TrajectoryStore.create(path)
    manager = TrajectoryManager(store, max_token_lag=4)
    add_one(manager, "before")
    store.flush()
    add_one(manager, "during")

    def full_disk(*args: object, **kwargs: object) -> None:  # a fake of a full disk, at h5py's write boundary
        if fault == "hdf5-runtime-error":
            raise RuntimeError(HDF5_FULL.format(path=path))
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as fake:
        fake.setattr(h5py.Dataset, "flush" if fault == "hdf5-runtime-error" else "__setitem__", full_disk)
        with pytest.raises(StoreFull) as raised:
            store.flush()
    message = str(raised.value)
    assert isinstance(raised.value, SfhpcError) and "\n" not in message
    assert message.startswith(f"{path}: cannot write the trajectory store (No space left on device; ")
    assert "MiB free on its file system" in message and "errno" not in message
    store.flush()  # room again: what was buffered is written
    manager.close()
    with open_store(path) as reader:
        assert sorted(t.id for t in reader.trajectories()) == ["before", "during"]


def test_closing_on_a_full_disk_says_so_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "trajectories.h5"
    store = TrajectoryStore.create(path)
    add_one(TrajectoryManager(store, max_token_lag=4), "x")

    def full_disk(*args: object, **kwargs: object) -> None:  # a fake of a full disk
        raise RuntimeError(HDF5_FULL.format(path=path))

    monkeypatch.setattr(h5py.Dataset, "flush", full_disk)
    monkeypatch.setattr(h5py.File, "flush", full_disk)
    monkeypatch.setattr(h5py.File, "close", full_disk)
    with pytest.raises(StoreFull):
        store.close()
    assert store.closed
    monkeypatch.undo()
    # The writer lock went with the close: another writer may take the store.
    fd = store_lock.take_writer_lock(path)
    store_lock.release_writer_lock(fd)


def test_another_writer_and_a_file_system_without_flock_are_told_apart(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "trajectories.h5"
    held = store_lock.take_writer_lock(path)
    try:
        with pytest.raises(StoreError, match="another process is writing this store"):
            store_lock.take_writer_lock(path)
    finally:
        store_lock.release_writer_lock(held)

    def no_flock(fd: int, operation: int) -> None:  # a fake of NFS mounted 'nolock'
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with pytest.raises(StoreError) as raised:
        store_lock.take_writer_lock(path)
    message = str(raised.value)
    assert "does not support file locks (flock: No locks available)" in message and "\n" not in message
    assert "nolock" in message and "output_dir" in message and "another process" not in message
