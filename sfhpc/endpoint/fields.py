"""The one reader of values in a request body: typed access where every refusal is a 400 naming the field.

Every route of the endpoint (the OpenAI routes' sampling parameters, token counts and seeds, an episode's
reward) reads its numbers here, so a rule about numbers holds for all of them at once. The rule that
matters most: a number is finite. Python's JSON decoder accepts ``NaN``, ``Infinity`` and ``-Infinity``
(and the in-process client passes Python floats as they are), and every range comparison with NaN is false,
so without this a ``{"temperature": NaN}`` would pass a range check, reach the engine and be recorded as
training data.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from sfhpc.endpoint.errors import BadRequest


class Fields:
    """Typed access to the fields of one decoded JSON object (a request body)."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def string(self, key: str, *, required: bool = False) -> str | None:
        value = self.body.get(key)
        if value is None:
            if required:
                raise BadRequest(f"'{key}' is required", param=key)
            return None
        if not isinstance(value, str):
            raise BadRequest(f"'{key}' must be a string", param=key)
        return value

    def boolean(self, key: str, *, default: bool) -> bool:
        value = self.body.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise BadRequest(f"'{key}' must be true or false", param=key)
        return value

    def integer(self, key: str, *, low: int | None = None, high: int | None = None) -> int | None:
        value = self.body.get(key)
        if value is None:
            return None
        _refuse_non_finite(key, value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise BadRequest(f"'{key}' must be an integer", param=key)
        if (low is not None and value < low) or (high is not None and value > high):
            raise BadRequest(f"'{key}' must be in [{low}, {high}], found {value}", param=key)
        return value

    def number(self, key: str, *, default: float | None, low: float = -math.inf, high: float = math.inf,
               low_open: bool = False, required: bool = False) -> float | None:
        """A finite number in ``[low, high]`` (``(low, high]`` with `low_open`); `default` when absent."""
        value = self.body.get(key)
        if value is None:
            if required:
                raise BadRequest(f"'{key}' is required: a finite number", param=key)
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise BadRequest(f"'{key}' must be a finite number", param=key)
        _refuse_non_finite(key, value)
        if value > high or value < low or (low_open and value == low):
            bracket = "(" if low_open else "["
            raise BadRequest(f"'{key}' must be in {bracket}{low}, {high}], found {value}", param=key)
        return float(value)

    def token_list(self, key: str, *, vocab_size: int) -> list[int] | None:
        value = self.body.get(key)
        if value is None:
            return None
        if isinstance(value, list):
            for item in value:
                _refuse_non_finite(key, item)
        if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise BadRequest(f"'{key}' must be a list of token ids", param=key)
        bad = [t for t in value if not 0 <= t < vocab_size]
        if bad:
            raise BadRequest(f"'{key}' holds token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
                             param=key)
        return value

    def refuse_unless(self, **allowed: tuple[Any, ...]) -> None:
        self._refuse_other_than(allowed, lambda key: "is not supported by this endpoint (it serves one sampled "
                                                     "completion per request); leave it out")

    def refuse_distribution_changes(self, **allowed: tuple[Any, ...]) -> None:
        """Sampling extensions that reshape the distribution (vLLM's names): the engine is not asked for
        them, so a request that sets one is refused rather than sampled otherwise than it asked."""
        self._refuse_other_than(allowed, lambda key: "is not supported: the endpoint samples from the model's "
                                                     f"whole distribution at the given temperature; leave '{key}' "
                                                     "out", code="unsupported_sampling")

    def _refuse_other_than(self, allowed: dict[str, tuple[Any, ...]], why: Callable[[str], str],
                           code: str | None = None) -> None:
        """A 400 for the first key of `allowed` present with a value outside its allowed values."""
        for key, values in allowed.items():
            if key in self.body:
                _refuse_non_finite(key, self.body[key])
                if self.body[key] not in values:
                    extra = {"code": code} if code else {}
                    raise BadRequest(f"'{key}' = {self.body[key]!r} {why(key)}", param=key, **extra)


def _refuse_non_finite(key: str, value: Any) -> None:
    # Checked before any type or range rule, so NaN and the infinities get the same message in every field.
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(f"'{key}' is {value!r}: NaN and infinities are not accepted; send a finite number",
                         param=key)
