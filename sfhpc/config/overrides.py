"""Recipe keys set on the command line over what the file says: ``sfhpc run RECIPE --set budgets.steps=10``.

An override is a dotted key and a YAML value (``--set evaluation.samples=4``, ``--set model.path=null``,
``--set 'evaluation={path: test.jsonl, every: 5}'``). It is applied to the file's data before the recipe is
built, so every rule of the loader checks it as if the file said it; a problem names the override (the file has
no line for it). ``null`` removes the key, so its default applies. A relative path given in an override is read
from the recipe's folder, like one the file gives.

The ranks and agent hosts load the recipe themselves: the launcher passes them the same overrides
(`as_arguments`), so every process builds the same recipe.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from sfhpc.config.yaml_source import LineDict
from sfhpc.errors import ConfigError

Overrides = Mapping[str, Any]


def parse(assignments: Iterable[str], source: str = "--set") -> dict[str, Any]:
    """``KEY=VALUE`` strings as {dotted key: value}; a malformed one is a ConfigError naming it."""
    out: dict[str, Any] = {}
    for text in assignments:
        key, sep, value = text.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(source, text, "expected KEY=VALUE with a dotted recipe key, e.g. budgets.steps=10")
        try:
            out[key] = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError as exc:
            raise ConfigError(source, key, f"the value {value!r} is not YAML ({str(exc).splitlines()[0]})") from None
    return out


def as_arguments(overrides: Overrides) -> list[str]:
    """The ``--set`` arguments that give `overrides` to another process (values as one-line YAML)."""
    args: list[str] = []
    for key, value in overrides.items():
        text = yaml.safe_dump(value, default_flow_style=True, width=1 << 20).strip()
        args += ["--set", f"{key}={text.removesuffix('...').strip()}"]
    return args


def apply(data: LineDict, overrides: Overrides, source: str) -> None:
    """Set each dotted key of `overrides` in `data` (a recipe file's mapping), creating sections as needed;
    ``None`` removes the key."""
    for key, value in overrides.items():
        *sections, last = key.split(".")
        node: dict[str, Any] = data
        for depth, name in enumerate(sections):
            child = node.get(name)
            if child is None:
                if value is None:
                    break  # nothing to remove
                child = _line_dict({})
                node[name] = child
            elif not isinstance(child, dict):
                raise ConfigError(source, key, f"--set: {'.'.join(sections[:depth + 1])} is a value, not a section")
            node = child
        else:
            if value is None:
                node.pop(last, None)
            else:
                node[last] = _line_dict(value)


def _line_dict(value: Any) -> Any:
    """`value` with its mappings as `LineDict`s of no line (what the loader expects of a file's data)."""
    if isinstance(value, dict):
        out = LineDict({k: _line_dict(v) for k, v in value.items()})
        out.key_lines = {}
        return out
    if isinstance(value, list):
        return [_line_dict(v) for v in value]
    return value
