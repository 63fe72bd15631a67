"""Verifiable rewards of a reply against a reference answer: built-in ones by name, the user's by import path.

A reward function takes ``(reply, answer)``: the policy's reply text and the row's reference answer as the
data file holds it, and returns a float (1.0 for right, 0.0 for wrong, or anything between).

* ``exact``: the reply, stripped, equals the answer, stripped.
* ``numeric``: the final number of the reply equals the final number of the answer. The final number is
  the one after the last ``####`` (GSM8K's answer mark) when there is one, else the last number of the
  text; thousands separators are ignored (``1,234`` is 1234).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sfhpc.config.import_path import check_callable, is_import_path, load_object
from sfhpc.errors import ConfigError

Reward = Callable[[str, Any], float]

ANSWER_MARK = "####"
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def exact(reply: str, answer: Any) -> float:
    return 1.0 if reply.strip() == str(answer).strip() else 0.0


def final_number(text: str) -> float | None:
    """The number a text gives as its answer (see the module's docstring); None when it gives none."""
    if ANSWER_MARK in text:
        found = NUMBER.search(text.rpartition(ANSWER_MARK)[2])
    else:
        found = None
        for found in NUMBER.finditer(text):  # noqa: B007 - the last match is the one wanted
            pass
    if found is None:
        return None
    digits = found.group().replace(",", "")
    try:
        return float(digits)
    except ValueError:
        return None


def numeric(reply: str, answer: Any) -> float:
    got, expected = final_number(reply), final_number(str(answer))
    if got is None or expected is None:
        return 0.0
    return 1.0 if math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-9) else 0.0


BUILTIN_REWARDS: dict[str, Reward] = {"exact": exact, "numeric": numeric}


def get_reward(name: Any, *, source: str, key: str, base_dir: Path | None) -> Reward:
    """The reward function `name` means: a built-in name, or ``module:function`` / ``file.py:function``."""
    if isinstance(name, str) and name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if not isinstance(name, str) or not is_import_path(name):
        raise ConfigError(source, key, f"unknown reward {name!r} (built-in: {', '.join(BUILTIN_REWARDS)}; or "
                                       "your own function as 'package.module:function' or 'file.py:function')")
    function = load_object(name, source=source, key=key, base_dir=base_dir)
    if isinstance(function, type):
        raise ConfigError(source, key, f"'{name}' is a class; a reward is a function (reply, answer) -> float")
    return check_callable(function, ("reply", "answer"), text=name, source=source, key=key)
