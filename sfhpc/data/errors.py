"""Errors of the data plane (trajectory manager, store, MPI service).

They are `SfhpcError`s, so a user sees one line. The agent endpoint maps them to HTTP statuses, which is
why "no such trajectory" (404) and "that trajectory no longer takes tokens" (409) are distinct classes.
"""

from __future__ import annotations

from sfhpc.errors import SfhpcError


class StoreError(SfhpcError):
    """A trajectory store cannot be created, opened or read; the message names the file."""


class StoreFull(StoreError):
    """The store's disk is full (or the user's quota spent): a write failed with ENOSPC / EDQUOT."""


class StoreExists(StoreError):
    """Creating a store would overwrite a file that is already there."""


class UnknownTrajectory(SfhpcError, KeyError):
    """No trajectory has this id (HTTP 404)."""

    def __str__(self) -> str:  # KeyError quotes its argument; show the message as it is
        return str(self.args[0]) if self.args else ""


class TrajectoryConflict(SfhpcError):
    """The request does not fit the trajectory's state (HTTP 409)."""


class TrajectoryFinished(TrajectoryConflict):
    """The trajectory is finished (or consumed, stale, aborted): it takes no more tokens."""


class TrajectoryExists(TrajectoryConflict):
    """`start` was given an id that is already in use."""


class InvalidRequest(SfhpcError, ValueError):
    """Arguments that can never be valid: lengths that disagree, an id that is too long (HTTP 400)."""


class ServiceError(SfhpcError):
    """The manager on the controller rank failed with an error that is not one of the above."""


# The MPI service sends errors by class name and raises the same class on the calling rank.
WIRE_ERRORS: dict[str, type[SfhpcError]] = {
    cls.__name__: cls
    for cls in (SfhpcError, StoreError, StoreFull, StoreExists, UnknownTrajectory, TrajectoryConflict,
                TrajectoryFinished, TrajectoryExists, InvalidRequest, ServiceError)
}
