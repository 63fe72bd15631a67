"""Benchmarks: the figures of merit, one command each (python -m sfhpc.bench.NAME)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from sfhpc.errors import SfhpcError


def run_as_script(main: Callable[[Sequence[str] | None], int]) -> NoReturn:
    """``python -m sfhpc.bench.NAME``: run `main`, a user error as one line and its exit code."""
    try:
        sys.exit(main(None))
    except SfhpcError as exc:
        print(f"sfhpc: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
