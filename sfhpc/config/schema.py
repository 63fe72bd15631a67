"""Build frozen dataclasses from YAML mappings, with errors that name file, line, key and expectation.

The dataclasses themselves are the schema: field names are the YAML keys, type hints say what a value
must be, defaults make a key optional. Supported hints: ``int``, ``float``, ``str``, ``bool``,
``Literal[...]``, ``X | None``, ``tuple[X, ...]`` (from a YAML list), nested dataclasses (from a
mapping) and ``tuple[D, ...]`` of dataclasses with a ``name`` field (from a mapping of name -> entry).
Fields with ``metadata={"yaml": False}`` are not YAML keys (the loader fills them in).
A dataclass may define ``validate(self, where)`` for checks between fields; it raises via ``where``.

Every YAML key carries its one-line description in the field's metadata (``setting(default, "...")``, or
``dataclasses.field(metadata=doc("..."))`` for a required key): the one owner of what a key means, beside
the field. `sfhpc.config.reference` prints them as the reference pages, and a test refuses a key without one.

A key that was renamed stays in a table of renamed keys (old dotted key -> new one; ``*`` stands for a role's
or a pool's name), which the loader gives to `build`: a recipe that still uses the old key gets "renamed to
X", one line, rather than "unknown key".

Strings are one plain line: a newline or any other control character is refused where it is read.
Recipe and map values end up in batch scripts (``#SBATCH`` lines, comments, shell words), where a
line break would start a new shell line. The one field that holds shell text on purpose is marked
``metadata={"shell": True}`` (``launch.setup``) and is exempt.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
import unicodedata
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, Union

from sfhpc.config.yaml_source import LineDict
from sfhpc.errors import ConfigError

T = TypeVar("T")

DOC = "doc"  # the metadata entry of a field's description
NO_RENAMES: Mapping[str, str] = {}


def doc(text: str, **metadata: Any) -> dict[str, Any]:
    """A field's metadata with its description (and any other entries, e.g. ``shell=True``)."""
    return {DOC: text, **metadata}


def setting(default: T, text: str, **metadata: Any) -> T:
    """A YAML key with a default and its one-line description: ``group_size: int = setting(8, "answers per
    prompt")``. A required key has no default: ``dataclasses.field(metadata=doc("..."))``."""
    return dataclasses.field(default=default, metadata=doc(text, **metadata))


def renamed_to(key_path: str, renamed: Mapping[str, str]) -> str | None:
    """The new name of the dotted `key_path` (``roles.trainer.gpus``) in a table of renamed keys, whose old
    keys may hold ``*`` for any one name (``roles.*.gpus``); None when it was not renamed."""
    parts = key_path.split(".")
    for old, new in renamed.items():
        pattern = old.split(".")
        if len(pattern) == len(parts) and all(p in ("*", part) for p, part in zip(pattern, parts)):
            names = iter(part for p, part in zip(pattern, parts) if p == "*")
            # The same names stand in the new key: roles.*.gpus -> roles.*.gpus_per_task keeps the role.
            return ".".join(next(names, "*") if n == "*" else n for n in new.split("."))
    return None


@dataclasses.dataclass(frozen=True)
class Where:
    """A position in a YAML file: the file, the dotted key path and the line (when known)."""

    source: str
    key: str
    line: int | None
    # The lines of this mapping's own keys, so that `validate` errors point at the key's line.
    key_lines: Mapping[str, int] | None = dataclasses.field(default=None, compare=False, repr=False)

    def child(self, key: str, mapping: Any = None) -> Where:
        lines = mapping if isinstance(mapping, LineDict) else None
        line = lines.line_of(key) if lines is not None else (self.key_lines or {}).get(key, self.line)
        return Where(self.source, f"{self.key}.{key}" if self.key else key, line)

    def error(self, problem: str) -> ConfigError:
        return ConfigError(self.source, self.key, problem, self.line)


def nearest(word: str, choices: typing.Iterable[str]) -> str:
    """A ' (did you mean ...?)' hint, or '' when nothing is close."""
    choices = list(choices)
    match = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    # Abbreviations (`gpus` for `gpus_per_node`) are far from their key by edit distance.
    match = match or [c for c in choices if len(word) >= 3 and c.startswith(word)][:1]
    return f" (did you mean '{match[0]}'?)" if match else ""


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint) if a is not type(None))
    if origin is tuple:
        return f"a list of {_describe(typing.get_args(hint)[0])}"
    if dataclasses.is_dataclass(hint):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        hint, str(hint)
    )


def build(cls: type[T], data: Any, where: Where, *, renamed: Mapping[str, str] = NO_RENAMES) -> T:
    """Convert the YAML value `data` into an instance of the dataclass `cls`. `renamed` is the document's
    table of renamed keys (dotted, from its top level)."""
    if not isinstance(data, dict):
        raise where.error(f"expected a mapping, found {_yaml_type(data)}")
    hints = typing.get_type_hints(cls)
    fields = {
        f.name: f
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.init and f.metadata.get("yaml", True)  # metadata yaml=False: set by code, not by users
    }
    for name in data:
        if name not in fields:
            at = where.child(name, data)
            new = renamed_to(at.key, renamed)
            if new is not None:
                raise at.error(f"renamed to '{new}' (see CHANGELOG.md)")
            raise at.error(f"unknown key{nearest(name, fields)}")
    if isinstance(data, LineDict):
        where = dataclasses.replace(where, key_lines=data.key_lines)
    values: dict[str, Any] = {}
    for name, field in fields.items():
        if name in data:
            values[name] = convert(hints[name], data[name], where.child(name, data),
                                   plain=not field.metadata.get("shell", False), renamed=renamed)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise where.error(f"missing required key '{name}' ({_describe(hints[name])})")
    instance = cls(**values)
    validate: Callable[[Where], None] | None = getattr(instance, "validate", None)
    if validate is not None:
        validate(where)
    return instance


def convert(hint: Any, value: Any, where: Where, *, plain: bool = True,
            renamed: Mapping[str, str] = NO_RENAMES) -> Any:
    """Convert one YAML value to the type `hint`, or raise a ConfigError at `where`. With `plain`, strings
    must be one line without control characters."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return convert(non_none[0], value, where, plain=plain, renamed=renamed)
        for arg in non_none:
            try:
                return convert(arg, value, where, plain=plain, renamed=renamed)
            except ConfigError:
                continue
        raise where.error(f"expected {_describe(hint)}, found {_yaml_type(value)}")
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            hint_text = nearest(str(value), [str(c) for c in choices])
            raise where.error(f"expected {_describe(hint)}, found {value!r}{hint_text}")
        return value
    if origin is tuple:
        (item,) = [a for a in typing.get_args(hint) if a is not Ellipsis]
        if dataclasses.is_dataclass(item) and isinstance(value, dict):
            return tuple(_named_entry(item, name, entry, where.child(name, value), renamed)
                         for name, entry in value.items())
        if isinstance(value, str) and item is str:
            value = [value]  # `tags: train` reads as `tags: [train]`
        if not isinstance(value, list):
            raise where.error(f"expected {_describe(hint)}, found {_yaml_type(value)}")
        return tuple(convert(item, v, Where(where.source, f"{where.key}[{i}]", where.line), plain=plain)
                     for i, v in enumerate(value))
    if dataclasses.is_dataclass(hint):
        return build(hint, value, where, renamed=renamed)  # type: ignore[arg-type]
    result = _scalar(hint, value, where)
    if plain and hint is str:
        check_plain(result, where)
    return result


def is_control(char: str) -> bool:
    """A line break or another control character: Cc (C0/C1 controls: newline, carriage return, tab,
    escape, NEL) or Zl/Zp (Unicode line and paragraph separators)."""
    return unicodedata.category(char) in ("Cc", "Zl", "Zp")


def check_plain(text: str, where: Where) -> None:
    """Refuse a string holding a line break or another control character (it would reach a batch script)."""
    for char in text:
        if is_control(char):
            what = "a newline" if char in "\n\r" else f"the control character U+{ord(char):04X}"
            raise where.error(f"holds {what}; values here must be one plain line (they are written into "
                              "the batch script; shell lines belong in launch.setup)")


def _named_entry(cls: Any, name: str, entry: Any, where: Where, renamed: Mapping[str, str]) -> Any:
    if entry is None:
        entry = {}
    if not isinstance(entry, dict):
        raise where.error(f"expected a mapping, found {_yaml_type(entry)}")
    if "name" in entry:
        raise where.child("name", entry).error("the name is the key above; remove this line")
    merged = LineDict(entry)
    merged.line, merged.key_lines = getattr(entry, "line", where.line), getattr(entry, "key_lines", {})
    merged["name"] = name
    return build(cls, merged, where, renamed=renamed)


def _scalar(hint: Any, value: Any, where: Where) -> Any:
    # bool is a subclass of int in Python; YAML's `yes` must not pass as the integer 1.
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:
            return float(value)  # PyYAML reads 1e-4 (no dot) as a string
        except ValueError:
            pass
    if hint is str and isinstance(value, str):
        return value
    if hint is Any:
        return value
    raise where.error(f"expected {_describe(hint)}, found {_yaml_type(value)} {value!r}")


def _yaml_type(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    return {dict: "a mapping", LineDict: "a mapping", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)
