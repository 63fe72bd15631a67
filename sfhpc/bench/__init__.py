"""Benchmarks: the figures of merit, one command each (python -m sfhpc.bench.NAME)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from sfhpc.errors import SfhpcError


def run_as_script(main: Callable[[Sequence[str] | None], int]) -> NoReturn:
    """``python -m sfhpc.bench.NAME``: run `main`, a user error as one line and its exit code."""
    try:
        sys.exit(main(None))
    except SfhpcError as exc:
        print(f"sfhpc: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)


def read_recipe_mapping(path: Path) -> dict[str, Any]:
    """A recipe file as plain YAML data, for a benchmark to derive its own variant from (one line if not)."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise SfhpcError(f"{path}: cannot read the recipe ({exc.strerror})") from None
    if not isinstance(data, dict):
        raise SfhpcError(f"{path}: expected a recipe (a YAML mapping)")
    return data
