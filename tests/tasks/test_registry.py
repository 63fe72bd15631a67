"""Which task a recipe's name means: built-in names imported only when named, user code by import path."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sfhpc.config import load_recipe
from sfhpc.config.recipe import TaskSpec
from sfhpc.errors import ConfigError
from sfhpc.tasks import Task, get_task
from sfhpc.tasks.letters import NextLetterTask

USER_TASKS = """\
import random

from sfhpc.tasks.base import Episode, Problem, StepResult, Task


class _Echo(Episode):
    def __init__(self, word):
        self.word = word

    def opening(self):
        return [{"role": "user", "content": f"say {self.word}"}]

    def step(self, reply):
        return StepResult(done=True, reward=float(reply == self.word))


class EchoTask(Task):
    name = "echo"

    def __init__(self, words=("yes", "no")):
        self.words = tuple(words)

    def sample(self, rng):
        word = rng.choice(self.words)
        return Problem(key=word, data=word)

    def episode(self, problem):
        return _Echo(problem.data)


def make_echo(words):
    return EchoTask(words)


def not_a_task():
    return 42


class Unfinished(Task):
    def sample(self, rng):
        return Problem("x", None)


NUMBER = 7
"""


def test_the_task_concept_imports_no_concrete_task() -> None:
    code = ("import sys, sfhpc.tasks; print(sorted(m for m in sys.modules if m.startswith('sfhpc.tasks.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "['sfhpc.tasks.base', 'sfhpc.tasks.registry']"


def test_built_in_names_build_their_task() -> None:
    task = get_task(TaskSpec("next-letter", {"letters": "ab"}))
    assert isinstance(task, NextLetterTask) and task.letters == "ab"


@pytest.mark.parametrize("name", ["user_tasks.py:EchoTask", "user_tasks.py:make_echo"])
def test_a_file_beside_the_recipe_is_found_from_any_working_folder(tmp_path: Path, name: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "user_tasks.py").write_text(USER_TASKS)
    (folder / "recipe.yaml").write_text(
        f'name: r\ntask: {{name: "{name}", options: {{words: [hi]}}}}\n'
        "roles: {controller: {place_with: trainer}, trainer: {tags: [t]}, rollout: {tags: [r]}}\n")
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe("project/recipe.yaml")  # relative: the folder is made absolute now
    assert recipe.task.base_dir == str(folder)
    monkeypatch.chdir("/")  # a rank's working folder may be another one
    task = get_task(recipe.task, recipe.source)
    assert type(task).__name__ == "EchoTask" and task.words == ("hi",)  # type: ignore[attr-defined]
    episode = task.episode(task.sample(__import__("random").Random(0)))
    assert episode.opening() == [{"role": "user", "content": "say hi"}] and episode.step("hi").reward == 1.0


def test_a_module_path_is_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_tasks_pkg").mkdir()
    (tmp_path / "my_tasks_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_tasks_pkg" / "echo.py").write_text(USER_TASKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    task = get_task(TaskSpec("my_tasks_pkg.echo:EchoTask"))
    assert isinstance(task, Task) and task.name == "echo"


@pytest.mark.parametrize(("name", "options", "expected"), [
    ("chess", None, "unknown task 'chess'"),
    ("no_such_module_xyz:Task", None, "cannot import 'no_such_module_xyz': ModuleNotFoundError"),
    ("missing.py:Task", None, "cannot import 'missing.py': FileNotFoundError"),
    ("broken.py:Task", None, "cannot import 'broken.py': ZeroDivisionError: division by zero"),
    ("user_tasks.py:NoSuchTask", None, "'user_tasks.py' has no 'NoSuchTask'"),
    ("user_tasks.py:NUMBER", None, "'user_tasks.py:NUMBER' is an object of type int, not a Task subclass"),
    ("user_tasks.py:Random", None, "'user_tasks.py:Random' is the class Random, not a Task subclass"),
    ("user_tasks.py:not_a_task", None, "'user_tasks.py:not_a_task' returned an object of type int, not a Task"),
    ("user_tasks.py:Unfinished", None, "'user_tasks.py:Unfinished' does not implement episode of Task"),
    ("user_tasks.py:EchoTask", {"colours": 3}, "bad options for task 'user_tasks.py:EchoTask': got an unexpected "
                                               "keyword argument 'colours' (it takes (words=('yes', 'no')))"),
    ("user_tasks.py:make_echo", {}, "bad options for task 'user_tasks.py:make_echo': missing a required argument: "
                                    "'words'"),
    ("next-letter", [1], "task.options: expected a mapping"),
])
def test_bad_user_code_is_one_config_error(tmp_path: Path, name: str, options: object, expected: str) -> None:
    (tmp_path / "user_tasks.py").write_text(USER_TASKS + "from random import Random\n")
    (tmp_path / "broken.py").write_text(textwrap.dedent("x = 1 / 0\n"))
    with pytest.raises(ConfigError) as caught:
        get_task(TaskSpec(name, options, base_dir=str(tmp_path)), "r.yaml")
    assert str(caught.value).startswith("r.yaml: task.") and expected in str(caught.value), str(caught.value)
    assert "\n" not in str(caught.value)
