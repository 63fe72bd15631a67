"""Errors the endpoint answers with, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every one is an `SfhpcError` with one actionable line, so the in-process client raises the very error
an HTTP agent would read in the response body.
"""

from __future__ import annotations

from typing import Any

from sfhpc.data.errors import InvalidRequest, TrajectoryConflict, UnknownTrajectory
from sfhpc.errors import SfhpcError


class EndpointError(SfhpcError):
    """A request the endpoint refuses; ``status`` is the HTTP status it answers with."""

    status = 400
    error_type = "invalid_request_error"
    default_code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}


class BadRequest(EndpointError):
    default_code = "invalid_request"


class ContextLengthExceeded(EndpointError):
    default_code = "context_length_exceeded"


class Unauthorized(EndpointError):
    status = 401
    default_code = "invalid_api_key"


class Forbidden(EndpointError):
    """A valid key used beyond what it opens (an episode's key on another episode)."""

    status = 403
    error_type = "permission_error"
    default_code = "forbidden"


class NotFound(EndpointError):
    status = 404
    default_code = "not_found"


class TrajectoryNotFound(NotFound):
    default_code = "trajectory_not_found"


class TrajectoryClosed(EndpointError):
    status = 409
    default_code = "trajectory_finished"


class MethodNotAllowed(EndpointError):
    status = 405
    default_code = "method_not_allowed"


class ServerError(EndpointError):
    status = 500
    error_type = "server_error"
    default_code = "internal_error"


class ShuttingDown(EndpointError):
    """The rank is stopping (end of run, or a stop signal): the turn's tokens so far are recorded and the
    trajectory continues after a restart."""

    status = 503
    error_type = "server_error"
    default_code = "shutting_down"


class EndpointConfigError(SfhpcError):
    """The endpoint cannot start as configured (e.g. exposed beyond loopback without a token)."""


def from_sink_error(exc: SfhpcError, trajectory_id: str) -> EndpointError:
    """The HTTP-facing form of an error the trajectory sink raised for `trajectory_id`."""
    if isinstance(exc, EndpointError):
        return exc
    if isinstance(exc, UnknownTrajectory):
        return TrajectoryNotFound(str(exc), param="trajectory_id")
    if isinstance(exc, TrajectoryConflict):
        return TrajectoryClosed(str(exc), param="trajectory_id")
    if isinstance(exc, InvalidRequest):
        return BadRequest(str(exc))
    return ServerError(f"the trajectory manager failed for {trajectory_id!r}: {exc}")
