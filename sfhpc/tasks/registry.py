"""Which task a recipe's ``task.name`` means: a built-in name, or user code by import path.

Built-in names map to import paths and are imported only when named, so the task concept
(`sfhpc.tasks.base`) knows no concrete task. A user's task is ``package.module:Name`` or ``file.py:Name``
(beside the recipe): a `Task` subclass, or a function that returns a `Task`, called with the recipe's
``task.options``. Each rank builds its own task from the recipe; the command line builds it first and
runs `Task.check`, so a name that does not import or options that do not fit stop before any job starts.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from sfhpc.config.import_path import is_import_path, load_object
from sfhpc.config.recipe import TaskSpec
from sfhpc.errors import ConfigError
from sfhpc.tasks.base import Task

BUILTIN_TASKS: dict[str, str] = {
    "next-letter": "sfhpc.tasks.letters:NextLetterTask",
    "guess-number": "sfhpc.tasks.guess_number:GuessNumberTask",
    "dataset": "sfhpc.tasks.dataset:DatasetTask",
    "arith-tool": "sfhpc.tasks.arith_tool:ArithToolTask",
    "repeat-letter": "sfhpc.tasks.long_tail:RepeatLetterTask",
    "letter-chain": "sfhpc.tasks.letter_chain:LetterChainTask",
}


def get_task(spec: TaskSpec, source: str = "recipe") -> Task:
    """The task a recipe names, built with its options; ConfigError for an unknown name, code that does not
    import, an object that is no task, or options it does not take."""
    if spec.name in BUILTIN_TASKS:
        target = BUILTIN_TASKS[spec.name]
    elif is_import_path(spec.name):
        target = spec.name
    else:
        known = ", ".join(sorted(BUILTIN_TASKS))
        raise ConfigError(source, "task.name", f"unknown task '{spec.name}' (built-in: {known}; or your own as "
                                               "'package.module:Name' or 'file.py:Name')")
    options = {} if spec.options is None else spec.options
    if not isinstance(options, dict):
        raise ConfigError(source, "task.options", "expected a mapping of option names to values")
    base_dir = Path(spec.base_dir) if spec.base_dir else None
    factory = load_object(target, source=source, key="task.name", base_dir=base_dir)
    if isinstance(factory, type) and issubclass(factory, Task):
        if inspect.isabstract(factory):
            missing = ", ".join(sorted(factory.__abstractmethods__))
            raise ConfigError(source, "task.name", f"'{spec.name}' does not implement {missing} of Task")
        if factory.from_options.__func__ is Task.from_options.__func__:  # type: ignore[attr-defined]
            _check_options(factory, options, spec.name, source)
        try:
            task = factory.from_options(options, source=source, base_dir=base_dir)
        except TypeError as exc:
            raise ConfigError(source, "task.options", f"bad options for task '{spec.name}': {exc}") from None
    elif callable(factory) and not isinstance(factory, type):
        _check_options(factory, options, spec.name, source)
        task = _call_user_code(factory, options, spec.name, source)
    else:
        raise ConfigError(source, "task.name", f"'{spec.name}' is {_kind(factory)}, not a Task subclass "
                                               "(sfhpc.tasks.Task) or a function that returns a Task")
    if not isinstance(task, Task):
        raise ConfigError(source, "task.name", f"'{spec.name}' returned {_kind(task)}, not a Task "
                                               "(sfhpc.tasks.Task)")
    return task


def _check_options(factory: Any, options: dict[str, Any], name: str, source: str) -> None:
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(**options)
    except TypeError as exc:
        raise ConfigError(source, "task.options", f"bad options for task '{name}': {exc} "
                                                  f"(it takes {signature})") from None


def _call_user_code(factory: Any, options: dict[str, Any], name: str, source: str) -> Any:
    try:
        return factory(**options)
    except ConfigError:
        raise
    except Exception as exc:  # the user's factory refused its options: say so in one line
        message = " ".join(str(exc).split()) or "(no message)"
        raise ConfigError(source, "task.options", f"task '{name}' failed to build: {type(exc).__name__}: "
                                                  f"{message}") from None


def _kind(obj: Any) -> str:
    return f"the class {obj.__name__}" if isinstance(obj, type) else f"an object of type {type(obj).__name__}"
