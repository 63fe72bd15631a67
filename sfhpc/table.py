"""Plain-text tables for terminal output."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "") -> str:
    """Left-aligned columns separated by two spaces, each as wide as its widest cell."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    return "\n".join(indent + "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in [header, *rows])
