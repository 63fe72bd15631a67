"""Verifiable rewards: the final number of a reply (GSM8K's ``####`` or the last number), exact text, and
the user's own function by import path, whose signature is checked when the recipe is."""

from __future__ import annotations

from pathlib import Path

import pytest

from sfhpc.errors import ConfigError
from sfhpc.tasks.rewards import exact, final_number, get_reward, numeric


@pytest.mark.parametrize(("text", "number"), [
    ("#### 42", 42), ("so 3 + 4 = 7\n#### 7", 7), ("#### 1,234", 1234), ("it is 5, then 12", 12),
    ("#### -3 apples", -3), ("2.5 and then #### 0.75", 0.75), ("1,000,000 people", 1_000_000),
    ("no number here", None), ("7 #### none", None), ("", None),
])
def test_final_number(text: str, number: float | None) -> None:
    assert final_number(text) == number


def test_numeric_compares_final_numbers_and_exact_compares_text() -> None:
    answer = "3 + 4 = 7\n#### 7"
    assert numeric("#### 7", answer) == 1.0
    assert numeric("I think 7.", answer) == 1.0
    assert numeric("#### 7.0", answer) == 1.0
    assert numeric("#### 8", answer) == 0.0 and numeric("7 or #### 8", answer) == 0.0
    assert numeric("seven", answer) == 0.0
    assert numeric("#### 1,234", 1234) == 1.0  # an answer the data file holds as a number
    assert exact(" Paris\n", "Paris") == 1.0 and exact("paris", "Paris") == 0.0


def test_a_user_reward_by_file(tmp_path: Path) -> None:
    (tmp_path / "scoring.py").write_text(
        "def half(reply, answer):\n    return 0.5 if reply == answer else 0.0\n"
        "def one_arg(reply):\n    return 1.0\n"
        "class Scorer:\n    pass\n"
        "LIMIT = 3\n")
    reward = get_reward("scoring.py:half", source="r.yaml", key="task.options.reward", base_dir=tmp_path)
    assert reward("a", "a") == 0.5 and reward("a", "b") == 0.0
    for name, expected in (
            ("scoring.py:one_arg", "'scoring.py:one_arg' has the signature (reply); it must take (reply, answer)"),
            ("scoring.py:LIMIT", "'scoring.py:LIMIT' is of type int, not a function"),
            ("scoring.py:Scorer", "'scoring.py:Scorer' is a class; a reward is a function (reply, answer)"),
            ("scoring.py:nothing", "'scoring.py' has no 'nothing'"),
            ("no_module_here:score", "cannot import 'no_module_here': ModuleNotFoundError"),
            ("fuzzy", "unknown reward 'fuzzy' (built-in: exact, numeric;")):
        with pytest.raises(ConfigError) as caught:
            get_reward(name, source="r.yaml", key="task.options.reward", base_dir=tmp_path)
        assert str(caught.value).startswith("r.yaml: task.options.reward: ") and expected in str(caught.value)
