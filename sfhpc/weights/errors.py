"""Errors of the weight stream a user (or a runtime built on it) can act on."""

from __future__ import annotations

from sfhpc.errors import SfhpcError


class WeightStreamError(SfhpcError):
    """The members of a weight-broadcast group disagree, or a side is used out of order."""
