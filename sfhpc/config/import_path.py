"""User code named in a recipe by import path: ``package.module:Name`` or ``file.py:Name``.

A ``.py`` file is read relative to the recipe's folder (made absolute when the recipe is loaded, since a
rank's working folder may differ from the one ``sfhpc`` was started in). Everything that can go wrong
(the module does not import, the name is missing, the object is of the wrong kind or takes the wrong
arguments) is a `ConfigError` naming the recipe and the key, so the command line refuses it in one line
before any job starts, and the ranks find the same code the check found.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sfhpc.errors import ConfigError


def is_import_path(text: str) -> bool:
    """Whether `text` names user code (``module:Name`` or ``file.py:Name``) rather than a built-in."""
    return isinstance(text, str) and ":" in text


def absolute_import_path(text: str, base_dir: Path) -> str:
    """`text` with a relative ``file.py`` made absolute against `base_dir`; a module path as it is."""
    module, sep, name = text.rpartition(":")
    if sep and module.endswith(".py") and not Path(module).is_absolute():
        return f"{(base_dir / module).resolve()}:{name}"
    return text


def load_object(text: str, *, source: str, key: str, base_dir: Path | None = None) -> Any:
    """The object ``module:Name`` (or ``file.py:Name``, relative to `base_dir`) names."""
    module_text, sep, name = text.rpartition(":")
    if not sep or not module_text or not name:
        raise ConfigError(source, key, f"'{text}' is not an import path: expected 'package.module:Name' or "
                                       "'file.py:Name'")
    try:
        if module_text.endswith(".py"):
            module = _load_file(Path(absolute_import_path(text, base_dir or Path.cwd()).rpartition(":")[0]))
        else:
            module = importlib.import_module(module_text)
    except ConfigError:
        raise
    except Exception as exc:  # any error of the user's module while it imports: the user's to fix
        raise ConfigError(source, key, f"cannot import '{module_text}': {type(exc).__name__}: "
                                       f"{_one_line(exc)}") from None
    obj: Any = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ConfigError(source, key, f"'{module_text}' has no '{name}'")
        obj = getattr(obj, part)
    return obj


def check_callable(obj: Any, args: tuple[str, ...], *, text: str, source: str, key: str,
                   alternative: str = "") -> Callable[..., Any]:
    """`obj` when it can be called with the positional arguments named in `args`; a ConfigError otherwise
    (naming `alternative`, another signature accepted, when given)."""
    if not callable(obj):
        raise ConfigError(source, key, f"'{text}' is of type {type(obj).__name__}, not a function")
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # some builtins have none: take them on trust
        return obj
    try:
        signature.bind(*args)
    except TypeError:
        raise ConfigError(source, key, f"'{text}' has the signature {signature}; it must take "
                                       f"({', '.join(args)}){' ' + alternative if alternative else ''}") from None
    return obj


def _load_file(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"no file {path}")
    # One module per file (its path's hash in the name), imported once: a file named twice is one module.
    name = f"sfhpc_user_{path.stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or "(no message)"
