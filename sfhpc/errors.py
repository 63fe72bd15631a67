"""Errors a user can act on.

Anything raised as `SfhpcError` reaches the command line as one line (``sfhpc: error: ...``) and a
non-zero exit, never as a traceback. The message must say what is wrong and, where it can, what to do.
"""

from __future__ import annotations


class SfhpcError(Exception):
    """An error caused by input or environment the user controls; its message is shown as it is."""

    exit_code = 2


class ConfigError(SfhpcError):
    """A YAML file does not describe a valid recipe or cluster map.

    The message names the file, the line (when known), the dotted key and what was expected.
    """

    def __init__(self, source: str, key: str, problem: str, line: int | None = None) -> None:
        self.source, self.key, self.problem, self.line = source, key, problem, line
        where = f"{source}:{line}" if line is not None else source
        super().__init__(f"{where}: {key}: {problem}" if key else f"{where}: {problem}")


class ResolveError(SfhpcError):
    """A recipe cannot be placed on the cluster described by a tag map."""


class SlurmError(SfhpcError):
    """A Slurm command failed or is missing."""
