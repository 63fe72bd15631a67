"""A run stops at start, with what to do, when the MPI library cannot be called from several threads."""

from __future__ import annotations

import pytest

from sfhpc.errors import SfhpcError
from sfhpc.runtime.mpi_threads import check_thread_level

MULTIPLE = 3  # MPI_THREAD_MULTIPLE in Open MPI and MPICH


def test_thread_multiple_passes() -> None:
    check_thread_level(MULTIPLE, MULTIPLE)


@pytest.mark.parametrize(("provided", "name"), [(0, "MPI_THREAD_SINGLE"), (1, "MPI_THREAD_FUNNELED"),
                                                (2, "MPI_THREAD_SERIALIZED")])
def test_less_is_refused_with_what_to_do(provided: int, name: str) -> None:
    with pytest.raises(SfhpcError) as info:
        check_thread_level(provided, MULTIPLE)
    message = str(info.value)
    assert message.startswith(f"the MPI library provides {name}, but sfhpc calls MPI from several threads")
    assert "needs MPI_THREAD_MULTIPLE" in message and "MPI4PY_RC_THREAD_LEVEL" in message


def test_an_unknown_numbering_is_still_named() -> None:
    with pytest.raises(SfhpcError, match="provides thread level 7, .* needs thread level 9"):
        check_thread_level(7, 9)
