"""Errors of the trainer that a user (or the component feeding it) can act on."""

from __future__ import annotations

from sfhpc.errors import SfhpcError


class TrainerError(SfhpcError):
    """The trainer cannot start or continue: a model folder, a checkpoint or a setting is wrong."""


class BatchError(TrainerError, ValueError):
    """A training batch whose parts disagree (shapes, masks, lengths); the message says which part."""


class CheckpointError(TrainerError):
    """A checkpoint is missing, unreadable or belongs to a different model; the message names the file."""
