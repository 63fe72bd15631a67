"""The MPI thread level a run needs: MPI_THREAD_MULTIPLE.

A rank calls MPI from several threads at once: the controller serves the trajectory manager in a
thread of its own while its main thread runs the loop; a rollout rank's agents record tokens from the
endpoint's event loop while its main thread takes commands and weights. An MPI library that provides
less either refuses such calls or corrupts them, which shows up much later as a hang or a crash.
mpi4py asks for MPI_THREAD_MULTIPLE when it initialises MPI; this checks what it got.
"""

from __future__ import annotations

from sfhpc.errors import SfhpcError

# The MPI standard orders the levels; Open MPI and MPICH both number them 0-3.
LEVEL_NAMES = {0: "MPI_THREAD_SINGLE", 1: "MPI_THREAD_FUNNELED", 2: "MPI_THREAD_SERIALIZED",
               3: "MPI_THREAD_MULTIPLE"}


def check_thread_level(provided: int, required: int) -> None:
    """Raise SfhpcError when the MPI library `provided` less than `required` (MPI.Query_thread() against
    MPI.THREAD_MULTIPLE)."""
    if provided >= required:
        return
    have, need = (LEVEL_NAMES.get(level, f"thread level {level}") for level in (provided, required))
    raise SfhpcError(
        f"the MPI library provides {have}, but sfhpc calls MPI from several threads of a rank and needs {need}: "
        "use an MPI built with thread support (Open MPI 4 or later does by default; MPICH: configure "
        "--enable-threads=multiple), make sure mpi4py was built against that MPI, and leave "
        "MPI4PY_RC_THREAD_LEVEL unset (or 'multiple')")
