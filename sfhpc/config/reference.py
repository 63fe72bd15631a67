"""The reference pages of the recipe and of the cluster map, printed from their dataclasses.

A key's description has one owner: its field (``setting(default, "...")`` in `sfhpc.config.recipe` and
`sfhpc.config.cluster`). This module walks the dataclasses as the loader reads them (`sfhpc.config.schema`)
and prints a page per document: one table per section (key, type, default, description), then the keys
that were renamed. The pages are committed under ``docs/``; a test fails when one differs from what this
prints, or when a key has no description.

    python -m sfhpc.config.reference docs            # write docs/recipe-reference.md, cluster-map-reference.md
    python -m sfhpc.config.reference --check docs    # exit 1 naming every page that is out of date
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union

from sfhpc.config import cluster, recipe
from sfhpc.config.schema import DOC

REGENERATE = "make docs (python -m sfhpc.config.reference docs)"


@dataclasses.dataclass(frozen=True)
class Key:
    """One row of a reference table."""

    name: str  # as written in the YAML file; "<role>" for the key of a named entry
    type: str
    default: str
    doc: str
    entry: bool = False  # the key of a named entry (a role's or a pool's name), not a key inside it


@dataclasses.dataclass(frozen=True)
class Section:
    """The keys of one mapping: the top level (path ""), ``model``, ``roles.<role>`` ..."""

    path: str
    doc: str  # the description of the key that holds the section
    keys: tuple[Key, ...]


@dataclasses.dataclass(frozen=True)
class Page:
    """A document kind: its top-level dataclass, its table of renamed keys, and the page's own text."""

    file: str
    title: str
    document: str  # what a user calls one: "recipe", "map"
    root: type
    renamed: Mapping[str, str]
    intro: str


PAGES = (
    Page("recipe-reference.md", "Recipe reference", "recipe", recipe.Recipe, recipe.RENAMED_KEYS,
         "A recipe is one YAML file: `sfhpc run RECIPE` runs it on one machine, `sfhpc launch RECIPE` submits it "
         "to Slurm. Sections nest as below (`budgets.steps` is `steps:` under `budgets:`); every key may be left "
         "out unless it says *required*. A key the loader does not know is refused in one line naming the file, "
         "line and key, and a renamed key names its new name. The [README](../README.md) has a complete recipe."),
    Page("cluster-map-reference.md", "Cluster map reference", "map", cluster.ClusterMap, cluster.RENAMED_KEYS,
         "The cluster map is the admin's YAML file that describes the hardware in capability tags "
         "(`sfhpc launch --cluster MAP`, or `$SFHPC_CLUSTER_MAP`). `sfhpc tags check MAP` compares it with the "
         "live cluster; [cluster-admins.md](cluster-admins.md) explains the tags and the site's prerequisites."),
)


def _yaml_keys(cls: type) -> Iterator[dataclasses.Field[Any]]:
    """The fields the loader reads from YAML, in order."""
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.init and field.metadata.get("yaml", True):
            yield field


def _dataclass_of(hint: Any) -> type | None:
    """D for a hint D or D | None, where D is a dataclass: a section."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    found = [a for a in args if isinstance(a, type) and dataclasses.is_dataclass(a)]
    return found[0] if len(found) == 1 else None


def _named_entries_of(hint: Any) -> type | None:
    """D for tuple[D, ...], where D is a dataclass: a mapping of names to sections (roles, pools)."""
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        if dataclasses.is_dataclass(item):
            return item  # type: ignore[return-value]
    return None


def _placeholder(cls: type) -> str:
    return f"<{cls.__name__.lower()}>"


def type_text(hint: Any) -> str:
    """How a type reads in the reference: "integer", "number or null", "list of strings", "`sync`, `async`
    or `seamless`"."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        names = [f"`{a}`" for a in typing.get_args(hint)]
        return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    if origin in (Union, types.UnionType):
        inner = " or ".join(type_text(a) for a in typing.get_args(hint) if a is not type(None))
        if type(None) not in typing.get_args(hint):
            return inner
        return f"{inner}, or null" if " or " in inner else f"{inner} or null"
    if origin is tuple:
        item = type_text(typing.get_args(hint)[0])
        return f"list of {item}s" if " " not in item else f"list of ({item})"
    if dataclasses.is_dataclass(hint):
        return "section"
    return {int: "integer", float: "number", str: "string", bool: "boolean", Any: "any"}.get(hint, str(hint))


def default_text(field: dataclasses.Field[Any]) -> str:
    """A field's default as YAML would write it; *required* when it has none."""
    if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
        return "*required*"
    value = field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, float):
        return f"`{value!r}`"
    return f"`{json.dumps(value)}`"


def _doc(field: dataclasses.Field[Any]) -> str:
    return str(field.metadata.get(DOC, "")).strip()


def sections(cls: type, path: str = "", doc: str = "") -> list[Section]:
    """The sections of the dataclass `cls` (the top level at `path` ""), each followed by those inside it."""
    hints = typing.get_type_hints(cls)
    keys: list[Key] = []
    nested: list[Section] = []
    entry_key = path.rpartition(".")[2] if path.endswith(">") else None  # a named entry's own key
    for field in _yaml_keys(cls):
        hint, where = hints[field.name], f"{path}.{field.name}" if path else field.name
        if entry_key is not None and field.name == "name":
            # The name of a role or pool is the key of its mapping entry, not a key inside it.
            keys.append(Key(entry_key, type_text(hint), "*required*", _doc(field), entry=True))
        elif (entries := _named_entries_of(hint)) is not None:
            inner = f"{where}.{_placeholder(entries)}"
            keys.append(Key(field.name, f"mapping of names to `{inner}`", default_text(field), _doc(field)))
            nested += sections(entries, inner, _doc(field))
        elif (section := _dataclass_of(hint)) is not None:
            optional = " (optional)" if typing.get_origin(hint) in (Union, types.UnionType) else ""
            keys.append(Key(field.name, f"section `{where}`{optional}", "", _doc(field)))
            nested += sections(section, where, _doc(field))
        else:
            keys.append(Key(field.name, type_text(hint), default_text(field), _doc(field)))
    return [Section(path, doc, tuple(keys)), *nested]


def undocumented(cls: type) -> list[str]:
    """Every key under the dataclass `cls` without a description, dotted (``budgets.steps``)."""
    return [f"{s.path}.{'name' if k.entry else k.name}" if s.path else k.name
            for s in sections(cls) for k in s.keys if not k.doc]


def key_paths(cls: type) -> set[str]:
    """Every key under the dataclass `cls`, dotted, with ``*`` for a role's or a pool's name: what a table
    of renamed keys may point to."""
    paths: set[str] = set()
    for section in sections(cls):
        prefix = ".".join("*" if part.startswith("<") else part for part in section.path.split(".") if part)
        paths.update(f"{prefix}.{key.name}" if prefix else key.name for key in section.keys if not key.entry)
    return paths


def _text(text: str) -> str:
    """Markdown for a description: outside `code`, <name> would be read as an HTML tag."""
    parts = text.split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;").replace(">", "&gt;") for i, p in enumerate(parts))


def _cell(text: str) -> str:
    """Markdown for a table cell: a pipe would end the cell, even inside `code`."""
    return _text(text).replace("|", "\\|")


def render(page: Page) -> str:
    """The page's markdown; ValueError naming every key without a description."""
    source = page.root.__module__.replace(".", "/") + ".py"
    missing = undocumented(page.root)
    if missing:
        raise ValueError(f"{source}: {', '.join(missing)}: no description; give each field one, "
                         "setting(default, '...') or dataclasses.field(metadata=doc('...')), then run " + REGENERATE)
    lines = [f"# {page.title}", "",
             f"<!-- Generated from {source} by {REGENERATE}; edit the descriptions there, not here. -->", "",
             page.intro, ""]
    for section in sections(page.root):
        lines += [f"## {'`' + section.path + '`' if section.path else 'Top level'}", ""]
        if section.doc:
            lines += [_text(section.doc[0].upper() + section.doc[1:]) + ".", ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for k in section.keys:
            name = f"`{k.name}` (the entry's own key)" if k.entry else f"`{k.name}`"
            lines.append(f"| {name} | {_cell(k.type)} | {k.default} | {_cell(k.doc)} |")
        lines.append("")
    lines += ["## Renamed keys", ""]
    if page.renamed:
        lines += ["An old key is refused with a line naming its new one.", "",
                  "| old key | new key |", "|---|---|"]
        lines += [f"| `{old}` | `{new}` |" for old, new in page.renamed.items()]
    else:
        lines.append(f"None yet. A key that is renamed stays listed here, and an old {page.document} that uses it "
                     "is refused with a line naming the new key.")
    return "\n".join(lines) + "\n"


def stale_pages(folder: Path) -> list[str]:
    """The pages under `folder` that differ from what `render` prints (missing ones included)."""
    return [page.file for page in PAGES
            if not (folder / page.file).is_file() or (folder / page.file).read_text(encoding="utf-8") != render(page)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sfhpc.config.reference",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("folder", nargs="?", default="docs", help="where the pages are (default: docs)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is out of date")
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    try:
        if args.check:
            stale = stale_pages(folder)
            for name in stale:
                print(f"{folder / name} is out of date: run {REGENERATE}", file=sys.stderr)
            return 1 if stale else 0
        for page in PAGES:
            (folder / page.file).write_text(render(page), encoding="utf-8")
            print(f"wrote {folder / page.file}")
    except (ValueError, OSError) as exc:
        print(f"sfhpc: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
