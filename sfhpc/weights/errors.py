"""Errors of the weight stream a user (or a runtime built on it) can act on."""

from __future__ import annotations

from sfhpc.errors import SfhpcError


class WeightStreamError(SfhpcError):
    """The members of a weight-broadcast group disagree, or a side is used out of order."""


class ModelFolderError(SfhpcError):
    """A model folder lacks the weights asked of it; the message names the folder."""
