"""HDF5 settings the store needs that h5py does not expose, set through the library h5py has loaded.

* Every open is without HDF5 file locking. HDF5 readers otherwise hold a shared lock on the file, and a
  run that restarts (after a preemption) could not reopen its store while an analyst's notebook has it
  open; and HDF5 refuses to open one file twice in a process with different locking settings. The store
  has its own writer lock (`store.lock_path`), and HDF5's writer mark keeps other programs from writing.
* Readers retry a metadata read at most `READ_ATTEMPTS` times. A SWMR reader retries reads whose checksum
  fails (the writer may be halfway through writing that block); HDF5's default of 100 attempts with a
  doubling sleep turns a damaged file into a wait of hours instead of an error.
* A writer reopening a file whose previous writer was killed must clear HDF5's "open for writing" mark,
  as `h5clear -s` does: it sets the library's file-access property ``clear_status_flags``. It must also
  move the file's end-of-allocation mark past everything on disk, as `h5clear --increment` does
  (`H5Fincrement_filesize`): the killed writer may have allocated and written chunks past the mark its
  superblock recorded, and new allocations from the stale mark would land on them (HDF5 then fails
  with "addr overflow", or worse, overwrites data).

Both HDF5 calls are public C API (`H5Pset_metadata_read_attempts`, `H5Pset`); they are made through
ctypes on the very libhdf5 h5py uses (found in this process's memory map), so the property ids match.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
from pathlib import Path

import h5py
from h5py import h5f, h5p

READ_ATTEMPTS = 16  # a torn read by a SWMR reader succeeds on a retry; a damaged block fails in ~0.1 s
CRASHED_WRITER_MESSAGE = "already open for write"  # part of HDF5's error when the writer mark is set


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The libhdf5 that h5py uses (not the high-level libhdf5_hl), or None if it cannot be found."""
    candidates: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            candidates = [line.split()[-1] for line in maps if "libhdf5" in line and "/" in line]
    except OSError:
        pass
    candidates += sorted(glob.glob(os.path.join(os.path.dirname(h5py.__file__), os.pardir, "h5py.libs", "libhdf5*")))
    for path in candidates:
        if "libhdf5_hl" not in os.path.basename(path) and os.path.exists(path):
            library = ctypes.CDLL(path)  # already loaded: the same handle h5py uses
            library.H5Pset.argtypes = [ctypes.c_int64, ctypes.c_char_p, ctypes.c_void_p]
            library.H5Pset.restype = ctypes.c_int
            library.H5Pset_metadata_read_attempts.argtypes = [ctypes.c_int64, ctypes.c_uint]
            library.H5Pset_metadata_read_attempts.restype = ctypes.c_int
            library.H5Fincrement_filesize.argtypes = [ctypes.c_int64, ctypes.c_uint64]
            library.H5Fincrement_filesize.restype = ctypes.c_int
            return library
    return None


def open_reader(path: Path, *, swmr: bool) -> h5py.File:
    """Open `path` read-only without HDF5 file locking, with few metadata read attempts (raises OSError)."""
    fapl = h5p.create(h5p.FILE_ACCESS)
    fapl.set_file_locking(False, True)
    library = _library()
    if library is not None:
        library.H5Pset_metadata_read_attempts(fapl.id, READ_ATTEMPTS)
    flags = h5f.ACC_RDONLY | (h5f.ACC_SWMR_READ if swmr else 0)
    return h5py.File(h5f.open(os.fsencode(path), flags, fapl=fapl))


def open_clearing_crash_mark(path: Path) -> h5py.File:
    """Open `path` read-write with HDF5's writer mark cleared; the caller guarantees no one else writes it."""
    library = _library()
    if library is None:
        raise OSError("the HDF5 library h5py uses was not found, so its writer mark cannot be cleared")
    fapl = h5p.create(h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5f.LIBVER_LATEST, h5f.LIBVER_LATEST)
    fapl.set_file_locking(False, True)
    clear = ctypes.c_bool(True)
    if library.H5Pset(fapl.id, b"clear_status_flags", ctypes.byref(clear)) < 0:
        raise OSError("this HDF5 library cannot clear a writer mark (no clear_status_flags property)")
    file_id = h5f.open(os.fsencode(path), h5f.ACC_RDWR, fapl=fapl)
    # End of allocation := max(recorded mark, end of file): nothing the dead writer wrote is reused.
    if library.H5Fincrement_filesize(file_id.id, 0) < 0:
        file_id.close()
        raise OSError("HDF5 could not move the end-of-allocation mark past the crashed writer's data")
    return h5py.File(file_id)
