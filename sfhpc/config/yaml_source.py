"""Read a YAML file into plain Python values while remembering the line of every mapping key.

Error messages then point at the line a user has to edit (``recipe.yaml:12: roles.rollout.nodes: ...``).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from sfhpc.errors import ConfigError


class LineDict(dict):
    """A mapping read from YAML: a plain dict plus the 1-based line of each key and of the mapping."""

    line: int | None = None
    key_lines: dict[str, int]

    def line_of(self, key: str) -> int | None:
        return self.key_lines.get(key, self.line)


class _LineLoader(yaml.SafeLoader):
    """SafeLoader whose mappings are `LineDict`s (no arbitrary object construction: recipes are data)."""


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> LineDict:
    loader.flatten_mapping(node)
    result = LineDict()
    result.line = node.start_mark.line + 1
    result.key_lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, str):
            raise ConfigError(
                loader.name, str(key), "keys must be strings", line=key_node.start_mark.line + 1
            )
        if key in result:
            raise ConfigError(loader.name, key, "key appears twice", line=key_node.start_mark.line + 1)
        result[key] = loader.construct_object(value_node, deep=True)
        result.key_lines[key] = key_node.start_mark.line + 1
    return result


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml(path: str | Path) -> LineDict:
    """Parse `path`; the top level must be a mapping. Raises ConfigError with the line of a syntax error."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(path), "", "file not found") from None
    except IsADirectoryError:
        raise ConfigError(str(path), "", "is a directory, expected a YAML file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), "", f"cannot be read ({exc})") from None
    loader = _LineLoader(text)
    loader.name = str(path)
    try:
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        problem = " ".join(str(p) for p in (exc.context, exc.problem) if p)
        raise ConfigError(str(path), "", f"malformed YAML: {problem}", line=line) from None
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), "", f"malformed YAML: {exc}") from None
    finally:
        loader.dispose()
    if not isinstance(data, LineDict):
        found = "an empty file" if data is None else f"a {type(data).__name__}"
        raise ConfigError(str(path), "", f"expected a mapping of keys at the top level, found {found}")
    return data

