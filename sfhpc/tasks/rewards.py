"""Verifiable rewards of a reply against a reference answer: built-in ones by name, the user's by import path.

A reward function takes ``(reply, answer)``: the policy's reply text and the row's reference answer as the
data file holds it, and returns a float (1.0 for right, 0.0 for wrong, or anything between). A function with
verl's signature, ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``, is recognised
by its parameters and called as verl calls it (`VerlReward`), with the row's ``data_source`` and
``extra_info``; it may return a number or a dict with ``score``.

* ``exact``: the reply, stripped, equals the answer, stripped.
* ``numeric``: the final number of the reply equals the final number of the answer. The final number is
  the one after the last ``####`` (GSM8K's answer mark) when there is one, else the last number of the
  text; thousands separators are ignored (``1,234`` is 1234).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from collections.abc import Callable, Mapping
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


VERL_ROW_KEYS = ("data_source", "extra_info")  # what a verl-signature reward reads from the row besides the answer


@dataclasses.dataclass(frozen=True)
class VerlReward:
    """A reward function with verl's signature: ``compute_score(data_source, solution_str, ground_truth,
    extra_info=None)``. It is called with keywords, the ones it takes: the row's ``data_source`` and
    ``extra_info`` (`VERL_ROW_KEYS`), the reply as ``solution_str``, the answer as ``ground_truth``; it returns
    a number or a dict with ``score`` (its other keys, verl's extra metrics, are not used)."""

    function: Callable[..., Any]
    text: str
    takes: frozenset[str]

    def __call__(self, reply: str, answer: Any, row: Mapping[str, Any] | None = None) -> float:
        given = {"solution_str": reply, "ground_truth": answer, **{k: (row or {}).get(k) for k in VERL_ROW_KEYS}}
        value = self.function(**{k: v for k, v in given.items() if k in self.takes})
        if isinstance(value, dict):
            value = value.get("score")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"the reward {self.text} returned {value!r}: it must return a number or a dict with "
                            "a numeric 'score'")
        return float(value)


def judge(reward: Reward | VerlReward, reply: str, answer: Any, row: Mapping[str, Any]) -> float:
    """The reward of `reply`: `row` holds what a `VerlReward` reads besides the answer."""
    if isinstance(reward, VerlReward):
        return reward(reply, answer, row)
    return float(reward(reply, answer))


def get_reward(name: Any, *, source: str, key: str, base_dir: Path | None) -> Reward | VerlReward:
    """The reward function `name` means: a built-in name, or ``module:function`` / ``file.py:function``."""
    if isinstance(name, str) and name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if not isinstance(name, str) or not is_import_path(name):
        raise ConfigError(source, key, f"unknown reward {name!r} (built-in: {', '.join(BUILTIN_REWARDS)}; or "
                                       "your own function as 'package.module:function' or 'file.py:function')")
    function = load_object(name, source=source, key=key, base_dir=base_dir)
    if isinstance(function, type):
        raise ConfigError(source, key, f"'{name}' is a class; a reward is a function (reply, answer) -> float")
    verl = _verl_parameters(function)
    if verl is not None:
        return VerlReward(function, name, verl)
    return check_callable(function, ("reply", "answer"), text=name, source=source, key=key,
                          alternative="or verl's (data_source, solution_str, ground_truth, extra_info)")


def _verl_parameters(function: Any) -> frozenset[str] | None:
    """The parameters a verl-signature function takes of `VerlReward`'s, or None when it has not verl's
    signature (``solution_str`` and ``ground_truth`` among its parameters, nothing else required)."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return None
    if not {"solution_str", "ground_truth"} <= set(parameters):
        return None
    known = {"solution_str", "ground_truth", *VERL_ROW_KEYS}
    required = {n for n, p in parameters.items() if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if required - known:
        return None
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return frozenset(known)
    return frozenset(known & set(parameters))
