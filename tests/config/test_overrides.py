"""``--set KEY=VALUE``: recipe keys over the file's, checked by the loader as if the file said them, and passed to
other processes unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from sfhpc.config import load_recipe
from sfhpc.config import overrides as set_keys
from sfhpc.errors import ConfigError
from tests.conftest import RECIPES


def test_overrides_set_remove_and_create_keys() -> None:
    base = load_recipe(RECIPES / "demo.yaml")
    given = set_keys.parse(["budgets.steps=3", "evaluation.samples=2", "evaluation.temperature=0.5",
                            "training.micro_batch_tokens=null", "seed=7"])
    assert given == {"budgets.steps": 3, "evaluation.samples": 2, "evaluation.temperature": 0.5,
                     "training.micro_batch_tokens": None, "seed": 7}
    recipe = load_recipe(RECIPES / "demo.yaml", given)
    assert (recipe.budgets.steps, recipe.seed) == (3, 7)
    assert recipe.budgets.prompts_per_step == base.budgets.prompts_per_step  # the rest of the section stays
    assert recipe.evaluation is not None and (recipe.evaluation.samples, recipe.evaluation.temperature) == (2, 0.5)
    # null removes the key: its default applies (8192 tokens here, since the demo does not set it)
    assert recipe.training.micro_batch_tokens == base.training.micro_batch_tokens
    # What another process is given builds the same recipe.
    args = set_keys.as_arguments(given)
    assert set_keys.parse(args[1::2]) == given
    flow = {"evaluation": {"samples": 3, "problems": 4}, "task.options.labels": ["a", "b"]}
    assert set_keys.parse(set_keys.as_arguments(flow)[1::2]) == flow


@pytest.mark.parametrize(("assignment", "fragment"), [
    ("budgets.steps", "expected KEY=VALUE"),
    ("budgets..steps=3", "expected KEY=VALUE"),
    ("budgets.steps=[1", "is not YAML"),
])
def test_a_malformed_override_is_one_line(assignment: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        set_keys.parse([assignment])


def test_an_override_is_checked_as_the_file_would_be(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="budgets.steps: .*at least|budgets.steps"):
        load_recipe(RECIPES / "demo.yaml", {"budgets.steps": -1})
    with pytest.raises(ConfigError, match="name.seed: --set: name is a value, not a section"):
        load_recipe(RECIPES / "demo.yaml", {"name.seed": 1})
