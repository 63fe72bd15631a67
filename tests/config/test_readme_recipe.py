"""The README's complete recipe is what it says: it loads, and its replies may be as long as its budget."""

from __future__ import annotations

import re
from pathlib import Path

from sfhpc.config import load_recipe
from sfhpc.rollout.agent import reply_budget, reply_budget_line
from sfhpc.tasks import get_task
from tests.conftest import ROOT


def readme_recipe(tmp_path: Path) -> Path:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Bring your own", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None, "the README's 'Bring your own' section has no yaml block"
    path = tmp_path / "my-run.yaml"
    path.write_text(block.group(1))
    # What the user brings beside it: the reward function it names.
    (tmp_path / "my_reward.py").write_text("def score(reply, answer):\n    return float(reply.strip() == answer)\n")
    return path


def test_the_readme_recipe_replies_within_its_own_budget(tmp_path: Path) -> None:
    recipe = load_recipe(readme_recipe(tmp_path))
    assert recipe.budgets.max_new_tokens == 1024
    task = get_task(recipe.task, recipe.source)
    # The data task does not narrow the budget: a reply (and an agent program's max_tokens) may hold 1,024.
    assert reply_budget(task, recipe.budgets.max_new_tokens) == 1024
    assert reply_budget_line(task, 1024) == "reply budget: 1024 tokens (budgets.max_new_tokens)"
    assert recipe.training.backend == "torch" and recipe.training.shards(16, on_gpu=True)


def test_a_task_that_narrows_the_budget_says_so() -> None:
    from sfhpc.tasks.letters import NextLetterTask

    line = reply_budget_line(NextLetterTask(), 1024)
    assert line == ("reply budget: 3 tokens: task 'next-letter' narrows budgets.max_new_tokens (1024) to its own "
                    "max_reply_tokens")
